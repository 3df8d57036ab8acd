"""``orchestr model``: local model checkpoints (``make-tiny`` writes a small one of a family)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import orchestr as oc

__all__ = ["add_parsers"]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def make_tiny(args: argparse.Namespace) -> int:
    from orchestr.roles import models

    try:
        folder = models.make_tiny(
            args.arch,
            args.dir,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate,
            vocab=args.vocab,
            shards=args.shards,
            experts=args.experts,
            experts_per_token=args.experts_per_token,
            seed=args.seed,
            tokenizer=args.tokenizer,
            init_std=args.init_std,
            force=args.force,
        )
        model = models.load_model(folder)  # what was written loads
    except oc.ConfigError as exc:
        print(f"orchestr model make-tiny: {exc}", file=sys.stderr)
        return 2
    params = sum(p.numel() for p in model.parameters())
    cfg = model.config
    experts = f", {cfg.moe.num_experts} experts" if cfg.moe else ""
    print(
        f"wrote {folder}: {cfg.model_type}, {cfg.num_hidden_layers} layers, hidden "
        f"{cfg.hidden_size}, {cfg.num_attention_heads}/{cfg.num_key_value_heads} heads"
        f"{experts}, vocab {cfg.vocab_size}, {params:,} parameters"
    )
    return 0


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("model", help="local model checkpoints (Hugging Face format)")
    cmds = p.add_subparsers(dest="model_command", required=True)
    c = cmds.add_parser(
        "make-tiny",
        help="write a small random checkpoint of a family, with a tokenizer trained locally",
    )
    c.add_argument(
        "--arch", required=True, help="the model family: llama, qwen2 or qwen2_moe (experts)"
    )
    c.add_argument(
        "dir",
        help="the folder to write: made if missing, else one of yours that only you may write "
        "to, and empty unless --force",
    )
    c.add_argument("--layers", type=_positive, default=2)
    c.add_argument("--hidden", type=_positive, default=64)
    c.add_argument("--heads", type=_positive, default=4)
    c.add_argument("--kv-heads", type=_positive, default=2)
    c.add_argument(
        "--intermediate",
        type=_positive,
        help="FFN width (default: 2.5 x hidden; for qwen2_moe each expert's, default hidden)",
    )
    c.add_argument("--experts", type=_positive, default=4, help="qwen2_moe: routed experts")
    c.add_argument(
        "--experts-per-token", type=_positive, default=2, help="qwen2_moe: experts per token"
    )
    c.add_argument("--vocab", type=_positive, default=512, help="the tokenizer's most tokens")
    c.add_argument(
        "--tokenizer",
        default="bpe",
        help="bpe (trained on generated text, with a chat template) or digits (the digit "
        "tasks' 15 tokens, ids as orchestr.roles.rl has them)",
    )
    c.add_argument(
        "--init-std", type=float, default=0.05, help="standard deviation of the weight matrices"
    )
    c.add_argument("--shards", type=_positive, default=1, help="weight files (>1: with an index)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument(
        "--force",
        action="store_true",
        help="write into a folder that is not empty, replacing the checkpoint files in it "
        "(config, tokenizer, weights) and keeping the rest",
    )
    c.set_defaults(func=make_tiny)
