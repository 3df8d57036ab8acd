"""What ``orchestr serve``'s options must be, checked before anything starts
(:func:`check_options`)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

__all__ = ["check_options", "labels", "loopback"]


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def labels(text: str) -> dict[str, str] | None:
    """``"k=v,k2=v2"`` as a dict; ``None`` when it is not that."""
    pairs = [item.partition("=") for item in text.split(",")]
    if any(not k or not sep or not v for k, sep, v in pairs):
        return None
    return {k: v for k, _, v in pairs}


def check_options(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, if anything."""
    folder = args.model_dir
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return f"{folder} is not a model folder (no config.json); make one with `orchestr model make-tiny`"
    if args.api_key is None and not loopback(args.host) and args.uds is None:
        return (
            f"--host {args.host} would open the model to the network without a key; give "
            f"--api-key-file (or $ORCHESTR_API_KEY), or bind a loopback address"
        )
    if args.api_key is not None and not args.api_key:
        return "the API key must not be empty"
    if args.restarts < 0:
        return f"--restarts must be 0 or more, got {args.restarts}"
    if args.kv_store_blocks < 0:
        return f"--kv-store-blocks must be 0 or more, got {args.kv_store_blocks}"
    if args.prefill < 0:
        return f"--prefill must be 0 or more, got {args.prefill}"
    if (args.engine == "sim") != (args.profile is not None):
        return (
            "--engine sim steps a step-time profile: give --profile FILE"
            if args.engine == "sim"
            else "--profile is --engine sim's"
        )
    if args.profile is not None:  # read by generators whose working folder may differ
        args.profile = os.path.abspath(args.profile)
    if args.prefill and args.engine == "vllm":
        return "--prefill hands off the native engine's KV blocks; --engine vllm cannot"
    if not args.prefill and (
        args.prefill_min_tokens
        or args.prefill_labels
        or args.no_prefill_overlap
        or args.spill_at
        or args.kv_read
    ):
        return (
            "--prefill-min-tokens, --prefill-labels, --no-prefill-overlap, --spill-at and "
            "--kv-read apply with --prefill P"
        )
    for flag in ("prefill_labels", "decode_labels"):
        if getattr(args, flag) is not None and labels(getattr(args, flag)) is None:
            return f"--{flag.replace('_', '-')} is K=V pairs separated by commas"
    if args.afd is not None:
        parts = args.afd.split(":")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            return f"--afd is A:E, attention generators and expert hosts (both 1 or more), got {args.afd!r}"
        if args.generators is not None:
            return "--afd A:E says how many generators there are; leave out --generators"
        args.generators, args.expert_hosts = (int(p) for p in parts)
    else:
        args.expert_hosts = 0
    args.generators = args.generators or 1
    if args.micro_batches < 1:
        return f"--micro-batches must be 1 or more, got {args.micro_batches}"
    if args.tp < 1:
        return f"--tp must be 1 or more, got {args.tp}"
    if args.tp > 1:
        if args.engine != "native":
            return f"--tp splits the native engine's model, not --engine {args.engine}'s"
        unsplit = [
            flag
            for flag, on in (
                ("--afd", args.expert_hosts),
                ("--micro-batches", args.micro_batches > 1),
            )
            if on
        ]
        if unsplit:
            return f"--tp > 1 cannot be combined with {', '.join(unsplit)} yet"
        if args.prefill and not args.no_prefill_overlap:
            # a split pool hands a prompt's blocks off whole, once computed: not layer by layer
            args.no_prefill_overlap = True
            print(
                "orchestr serve: note: --tp > 1 hands each prompt's KV off once it is all "
                "computed (--no-prefill-overlap): a split pool does not stream it",
                file=sys.stderr,
            )
    weight = args.router_prefill_weight
    if weight is not None and args.router != "kv":
        return f"--router-prefill-weight prices the kv router's cost; --router is {args.router}"
    if weight is not None and not 0 <= weight < float("inf"):
        return f"--router-prefill-weight must be a number 0 or more, got {weight}"
    if (args.afd or args.micro_batches > 1) and args.engine != "native":
        return f"--afd and --micro-batches run the native engine's model; --engine {args.engine} cannot"
    if args.kv_store_blocks and args.engine == "vllm":
        return "--kv-store-blocks backs the native engine's prefix cache; --engine vllm has its own"
    return None
