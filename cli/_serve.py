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
import ipaddress
import os
import signal
import socket
import stat
import sys
from collections.abc import Iterator
from typing import Any

import orchestr

from ._models import _positive

__all__ = ["add_parsers"]

ENGINES = {"native": "paged", "vllm": "vllm"}
#: The router's policies (``orchestr.roles.serving.POLICIES``, not imported here: that loads
#: torch, and every ``orchestr`` command builds this parser).
ROUTERS = ("kv", "round_robin", "least_loaded")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _labels(text: str) -> dict[str, str] | None:
    """``"k=v,k2=v2"`` as a dict; ``None`` when it is not that."""
    pairs = [item.partition("=") for item in text.split(",")]
    if any(not k or not sep or not v for k, sep, v in pairs):
        return None
    return {k: v for k, _, v in pairs}


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, if anything."""
    folder = args.model_dir
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return f"{folder} is not a model folder (no config.json); make one with `orchestr model make-tiny`"
    if args.api_key is None and not _loopback(args.host) and args.uds is None:
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
    if args.prefill and args.engine != "native":
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
        if getattr(args, flag) is not None and _labels(getattr(args, flag)) is None:
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
    weight = args.router_prefill_weight
    if weight is not None and args.router != "kv":
        return f"--router-prefill-weight prices the kv router's cost; --router is {args.router}"
    if weight is not None and not 0 <= weight < float("inf"):
        return f"--router-prefill-weight must be a number 0 or more, got {weight}"
    if (args.afd or args.micro_batches > 1) and args.engine != "native":
        return "--afd and --micro-batches run the native engine; --engine vllm cannot"
    if args.kv_store_blocks and args.engine != "native":
        return "--kv-store-blocks backs the native engine's prefix cache; --engine vllm has its own"
    return None


async def _serve(ctx: orchestr.JobContext, args: argparse.Namespace) -> None:
    import uvicorn

    from orchestr.roles.serving import openai_server

    options: dict[str, Any] = {"max_batch": args.max_batch}
    if args.torch_threads:
        options["torch_threads"] = args.torch_threads
    if args.kv_read:
        options["kv_read"] = args.kv_read
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
            pool: {"labels": _labels(text)}
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
            # connections beyond the front door's admission are refused (503) by uvicorn
            limit_concurrency=args.max_pending + 64,
        )
        server = _server_class()(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.exit)
        sockets = None if args.uds is None else [_private_socket(args.uds)]
        task = asyncio.create_task(server.serve(sockets=sockets))
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
            if args.expert_hosts:
                pools += f" over {args.expert_hosts} expert host(s)"
                pools += f" in {args.micro_batches} micro-batches" if args.micro_batches > 1 else ""
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


def _private_socket(path: str) -> socket.socket:
    """A Unix-domain socket listening at ``path`` with mode 0600 from its creation (uvicorn's
    own makes it 0666); a socket left there by an earlier server of this user is replaced,
    anything else is refused."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise orchestr.ConfigError(
                f"--uds {path}: something other than a socket of yours is there; remove it or "
                f"choose another path"
            )
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise orchestr.ConfigError(f"--uds {path}: cannot bind ({exc.strerror})") from None
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(2048)
    return sock


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server without its own signal handling (it raises the signal again
        once stopped): ``orchestr serve`` stops it, then closes the front door and the job."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

        def exit(self) -> None:
            if self.should_exit:
                self.force_exit = True  # a second signal: stop without waiting
            self.should_exit = True

    return Server


def _read_key(path: str) -> str:
    """The API key in ``path``: a regular file that only its owner can read (as ssh asks of
    a private key), its first line."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"--api-key-file {path}: {exc.strerror}") from None
    with os.fdopen(fd, encoding="utf-8") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"--api-key-file {path}: not a regular file")
        if st.st_mode & 0o077:
            raise ValueError(
                f"--api-key-file {path}: other users can read or write it (mode "
                f"{stat.S_IMODE(st.st_mode):04o}); chmod 600 it"
            )
        key = f.readline(4096).strip()
    if not key:
        raise ValueError(f"--api-key-file {path}: the file is empty")
    return key


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
            args.api_key = _read_key(args.api_key_file)
        except ValueError as exc:
            print(f"orchestr serve: {exc}", file=sys.stderr)
            return 2
    else:
        args.api_key = os.environ.get("ORCHESTR_API_KEY")
    problem = _check(args)
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
        help="native: orchestr's paged engine (default); vllm: vLLM's engine (the vllm extra)",
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
