"""This machine's limits for ``bench/cluster.py``: starting processes, and a bare gRPC round trip.

    python bench/_limit_spawn.py procs N CONCURRENCY -- CMD...   # one JSON line
    python bench/_limit_spawn.py grpc-serve HOST                   # prints its port, serves
    python bench/_limit_spawn.py grpc-call HOST:PORT SECONDS      # one JSON line

- ``procs`` starts ``N`` processes of ``CMD``, at most ``CONCURRENCY`` at a time (fork, exec,
  the interpreter's start-up and whatever ``CMD`` imports, exit), and reports the wall time for
  all of them. With ``python -c pass`` that is the least any runtime that gives an actor a
  Python process of its own pays; with ``python -c "import orchestr._cluster._worker"`` the least an
  orchestr worker pays before it serves anything.
- ``grpc-call`` makes sequential unary calls with 16-byte bodies to ``grpc-serve`` (grpc.aio,
  raw bytes: no protobuf) for ``SECONDS`` and reports every round trip's time: the least a
  control-plane request between two hosts costs.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import grpc
import uvloop

METHOD = "/bench.Echo/Echo"


async def start_many(n: int, concurrency: int, cmd: list[str]) -> float:
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.DEVNULL)
            if await proc.wait() != 0:
                raise RuntimeError(f"{cmd} exited {proc.returncode}")

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return time.perf_counter() - start


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


async def serve(host: str) -> None:
    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(_echo)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler}),)
    )
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def call(address: str, seconds: float) -> list[float]:
    async with grpc.aio.insecure_channel(address) as channel:
        echo = channel.unary_unary(METHOD)
        body = b"x" * 16
        for _ in range(200):  # warm-up: the connection, the first calls
            await echo(body)
        times = []
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            await echo(body)
            times.append(time.perf_counter() - start)
    return times


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "procs":
        n, concurrency = int(argv[1]), int(argv[2])
        cmd = argv[argv.index("--") + 1 :]
        seconds = uvloop.run(start_many(n, concurrency, cmd))
        print(json.dumps({"n": n, "concurrency": concurrency, "seconds": seconds}))
    elif mode == "grpc-serve":
        uvloop.run(serve(argv[1]))
    elif mode == "grpc-call":
        print(json.dumps({"seconds": uvloop.run(call(argv[1], float(argv[2])))}))
    else:
        raise SystemExit(f"unknown mode {mode!r}: procs, grpc-serve or grpc-call")


if __name__ == "__main__":
    main(sys.argv[1:])
