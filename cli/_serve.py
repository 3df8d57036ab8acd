"""``orchestr serve MODEL_DIR``: generators of a checkpoint behind OpenAI's API.

It runs on the running cluster (``--address``, ``$ORCHESTR_ADDRESS`` or the state directory's
head) or on an embedded one, spawns ``--generators`` generator actors and serves the front
door (:mod:`orchestr.roles.serving`) with uvicorn until SIGINT or SIGTERM; then the front
door closes (requests in flight end) and the generators stop with the job.

Without a key (``--api-key-file``, ``$ORCHESTR_API_KEY``, or ``--api-key``, which every local
user can read in the process list) it binds only a loopback address: a model open to the
network without a key is refused. A loopback address is open to every user of the host;
``--uds PATH`` serves on a Unix-domain socket of mode 0600 instead, which only this user (and
root) can open. TLS is for a reverse proxy in front.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from typing import Any

import orchestr
from orchestr.tasks import TaskOwner

from ._listen import private_socket, read_key, server_class
from ._models import _positive
from ._serve_options import check_options, labels

__all__ = ["add_parsers"]

ENGINES = {"native": "paged", "vllm": "vllm", "sim": "sim"}
#: The router's policies (``orchestr.roles.serving.POLICIES``, not imported here: that loads
#: torch, and every ``orchestr`` command builds this parser).
ROUTERS = ("kv", "round_robin", "least_loaded")


async def _serve(ctx: orchestr.JobContext, args: argparse.Namespace) -> None:
    import uvicorn

    from orchestr.roles.serving import openai_server

    options: dict[str, Any] = {"max_batch": args.max_batch}
    if args.torch_threads:
        options["torch_threads"] = args.torch_threads
    if args.kv_read:
        options["handoff"] = {"read": args.kv_read}
    if args.tp > 1:
        options["tp"] = args.tp
    if args.profile is not None:
        options["profile"] = args.profile
    async with openai_server(
        ctx,
        args.model_dir,
        generators=args.generators,
        engine=ENGINES[args.engine],
        names=args.served_model_name or [],
        router=_router(args),
        api_key=args.api_key,
        max_pending=args.max_pending,
        resend=args.resend,
        restarts=args.restarts,
        options=options,
        kv_store_blocks=args.kv_store_blocks,
        prefill=args.prefill,
        prefill_overlap=not args.no_prefill_overlap,
        spill_at=args.spill_at,
        expert_hosts=args.expert_hosts,
        micro_batches=args.micro_batches,
        **({"prefill_min_tokens": args.prefill_min_tokens} if args.prefill_min_tokens else {}),
        placement={
            pool: {"labels": labels(text)}
            for pool, text in (("prefill", args.prefill_labels), ("decode", args.decode_labels))
            if text
        },
    ) as app:
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
        server = server_class()(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.exit)
        sockets = None if args.uds is None else [private_socket(args.uds)]
        async with TaskOwner() as tasks:  # the server stops before the app it serves
            task = tasks.start(server.serve(sockets=sockets))
            while not server.started and not task.done():  # noqa: ASYNC110 (uvicorn has no event)
                await asyncio.sleep(0.05)
            if server.started:
                if args.uds is not None:
                    where = f"unix:{args.uds} (mode 0600)"
                else:
                    port = server.servers[0].sockets[0].getsockname()[1]
                    where = f"http://{args.host}:{port}/v1"
                name = (args.served_model_name or [args.model_dir])[0]
                pools = f"{args.generators} {args.engine} generator(s)"
                if args.prefill:
                    pools = f"{args.prefill} prefill + {args.generators} decode generator(s)"
                if args.tp > 1:
                    pools += f" of tp={args.tp}"
                if args.expert_hosts:
                    pools += f" over {args.expert_hosts} expert host(s)"
                    pools += (
                        f" in {args.micro_batches} micro-batches" if args.micro_batches > 1 else ""
                    )
                router = args.router
                if args.router_prefill_weight is not None:
                    router += f" (prefill weight {args.router_prefill_weight:g})"
                print(f"serving {name} on {where} with {pools}, router {router}", flush=True)
            try:
                await task  # until SIGINT or SIGTERM, or it fails to bind
            finally:
                if args.uds is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(args.uds)
        if not server.started:
            raise orchestr.ConfigError(f"could not serve on {args.host}:{args.port} (see above)")


def serve(args: argparse.Namespace) -> int:
    if args.api_key is not None and args.api_key_file is not None:
        print("orchestr serve: give --api-key-file or --api-key, not both", file=sys.stderr)
        return 2
    if args.api_key is not None:
        print(
            "orchestr serve: warning: --api-key shows the key to every user of this host (in "
            "the process list); use --api-key-file or $ORCHESTR_API_KEY",
            file=sys.stderr,
        )
    elif args.api_key_file is not None:
        try:
            args.api_key = read_key(args.api_key_file)
        except ValueError as exc:
            print(f"orchestr serve: {exc}", file=sys.stderr)
            return 2
    else:
        args.api_key = os.environ.get("ORCHESTR_API_KEY")
    problem = check_options(args)
    if problem is not None:
        print(f"orchestr serve: {problem}", file=sys.stderr)
        return 2
    from ._main import _cluster_of

    try:
        address, token = _cluster_of(args)

        async def main(ctx: orchestr.JobContext) -> None:
            await _serve(ctx, args)

        orchestr.run(main, address=address, token=token)
    except orchestr.OrchestrError as exc:
        print(f"orchestr serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print("orchestr serve: stopped", file=sys.stderr)
    return 0


def _router(args: argparse.Namespace) -> Any:
    """The router policy's name, or a kv :class:`~orchestr.roles.serving.Router` with the
    prefill weight given."""
    if args.router_prefill_weight is None:
        return args.router
    from orchestr.roles.serving import Router

    return Router(args.router, prefill_weight=args.router_prefill_weight)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is from 0 to 65535, got {value}")
    return value


def add_parsers(sub: Any, state_dir_help: str) -> None:
    p = sub.add_parser(
        "serve", help="serve a checkpoint over OpenAI's API (completions, chat, streaming)"
    )
    p.add_argument("model_dir", metavar="MODEL_DIR", help="a Hugging Face format model folder")
    p.add_argument(
        "--generators",
        "--decode",
        type=_positive,
        default=None,
        help="generator actors (default 1); with --prefill, the decode pool",
    )
    p.add_argument(
        "--afd",
        default=None,
        metavar="A:E",
        help="attention/FFN disaggregation: A generators run attention (and hold the KV "
        "cache), E expert hosts hold a MoE checkpoint's routed experts, or a dense one's "
        "MLPs in E slices",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor parallelism: split each generator's model over N processes on its host "
        "(attention heads, MLP and vocabulary; native engine; default 1)",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        metavar="N",
        help="split each engine step into N ping-pong micro-batches, so attention of one "
        "overlaps the experts of another (default 1: off)",
    )
    p.add_argument(
        "--prefill",
        type=int,
        default=0,
        metavar="P",
        help="prefill generators: prompts are computed there and their KV handed to the "
        "decode pool (native engine; default 0: every generator does both)",
    )
    p.add_argument(
        "--prefill-min-tokens",
        type=_positive,
        default=None,
        metavar="T",
        help="with --prefill, shorter prompts are prefilled where they decode (default 64)",
    )
    p.add_argument(
        "--no-prefill-overlap",
        action="store_true",
        help="with --prefill, read a prompt's KV once it is all computed, not layer by layer "
        "as it is",
    )
    p.add_argument(
        "--kv-read",
        choices=("direct", "staged"),
        default=None,
        help="with --prefill, how a decode generator reads a prompt's KV: direct (the default) "
        "copies it into its cache straight from a prefill generator's memory on its host, once "
        "computed; staged reads it into a copy first (layer by layer unless "
        "--no-prefill-overlap), as it must from another host",
    )
    p.add_argument(
        "--spill-at",
        type=_positive,
        default=None,
        metavar="R",
        help="with --prefill, once every decode generator has R requests, serve new ones whole "
        "(prefill and decode) on a less busy prefill generator (default: never)",
    )
    p.add_argument(
        "--prefill-labels",
        default=None,
        metavar="K=V,...",
        help="node labels the prefill generators are placed on",
    )
    p.add_argument(
        "--decode-labels",
        default=None,
        metavar="K=V,...",
        help="node labels the other generators (decode, or all without --prefill) are placed on",
    )
    p.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="native",
        help="native: orchestr's paged engine (default); vllm: vLLM's engine (the vllm extra); "
        "sim: the paged engine's scheduler with no model, each step lasting what --profile says",
    )
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="--engine sim's step-time profile (`orchestr sim calibrate`'s JSON, or one of its "
        "fields' values for another machine)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port to bind (default 8000; 0: any)")
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="a file (mode 0600) holding the key clients send as `Authorization: Bearer KEY`; "
        "or set $ORCHESTR_API_KEY. Without a key only a loopback address is bound, and every "
        "user of this host can reach the server there: use --uds for one only you can open",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="the key itself (shown to every local user in the process list: prefer "
        "--api-key-file or $ORCHESTR_API_KEY)",
    )
    p.add_argument(
        "--uds",
        default=None,
        metavar="PATH",
        help="serve on a Unix-domain socket at PATH, mode 0600 (only you and root can connect), "
        "instead of --host/--port. TLS is not served here: put a reverse proxy in front",
    )
    p.add_argument(
        "--router", choices=ROUTERS, default="kv", help="how requests pick a generator (default kv)"
    )
    p.add_argument(
        "--router-prefill-weight",
        type=float,
        default=None,
        metavar="W",
        help="with --router kv, the weight of prompt blocks to compute (the request's and those "
        "queued) against blocks decoding in its cost (default 1.0, Dynamo's)",
    )
    p.add_argument(
        "--max-batch", type=_positive, default=32, help="sequences per engine step (default 32)"
    )
    p.add_argument(
        "--max-pending",
        type=_positive,
        default=256,
        help="requests in flight before more are refused with 429 (default 256)",
    )
    p.add_argument(
        "--resend",
        action="store_true",
        help="send a request whose generator died to another one (if no token was sent yet)",
    )
    p.add_argument(
        "--restarts",
        type=int,
        default=3,
        help="restarts per generator that dies (default 3); the front door serves on the "
        "others meanwhile, and on it again once it is back",
    )
    p.add_argument(
        "--kv-store-blocks",
        type=int,
        default=0,
        metavar="N",
        help="a KV store of N blocks in host memory behind the generators' prefix caches "
        "(native engine; default 0: none)",
    )
    p.add_argument(
        "--torch-threads", type=_positive, default=None, help="torch threads per generator"
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model's names in the API (default MODEL_DIR)",
    )
    p.add_argument(
        "--address",
        metavar="HOST:PORT",
        help="serve on the cluster whose head serves there (default: $ORCHESTR_ADDRESS, else "
        "the state directory's running head, else an embedded cluster)",
    )
    p.add_argument("--state-dir", help=state_dir_help)
    p.set_defaults(func=serve)
