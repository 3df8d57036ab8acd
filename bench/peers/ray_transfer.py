"""Large-tensor transfer between two Ray actors, the peer half of ``bench/transfer.py``.

Run with the Ray transfer venv's interpreter (``ray==2.60.0`` and numpy; see
``bench/_venvs.py``)::

    bench/.venvs/ray-transfer/bin/python bench/peers/ray_transfer.py CASES [--address HOST:PORT]

``CASES`` is a comma list of ``NBYTES:ITERS:WARMUP``. Without ``--address`` Ray starts locally
(``num_cpus=2``, a 3 GiB object store, no dashboard) and both actors share the host. With it the
driver joins a running two-node cluster whose nodes carry the custom resources ``hostA`` and
``hostB``; the sender is placed on ``hostA``, the receiver on ``hostB``.

Per iteration the sender refreshes a preallocated float32 numpy array in place (``+= 1``,
untimed) and times ``ray.get(receiver.take.remote(arr))``: Ray puts the argument into the
object store and the receiver gets a zero-copy view of it (through the other node's store when
the receiver is remote); ``take`` returns ``arr.nbytes``. Warm-up iterations run first.
Each actor reports its resident set before a case and its peak during it (``VmRSS``/``VmHWM``;
the peak is reset through ``/proc/self/clear_refs``).

Progress goes to stderr; the last line of stdout is one JSON object:
``{"cases": {"NBYTES": {"seconds": [...], "sender": {...}, "receiver": {...}}}, "placement":
{...}, "_versions": {...}}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np
import ray

OBJECT_STORE_BYTES = 3 << 30


def memory(reset: bool) -> dict[str, int]:
    """This process's resident set and its peak, in bytes; ``reset`` restarts the peak."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    return {"rss": out["VmRSS"], "hwm": out["VmHWM"], "pid": os.getpid()}


@ray.remote
class Receiver:
    def take(self, arr: np.ndarray) -> int:
        return int(arr.nbytes)

    def memory(self, reset: bool) -> dict[str, int]:
        return memory(reset)

    def where(self) -> str:
        return ray.util.get_node_ip_address()


@ray.remote
class Sender:
    def run(
        self, receiver: ray.actor.ActorHandle[Receiver], nbytes: int, iters: int, warmup: int
    ) -> list[float]:
        """Refresh, send and wait ``warmup + iters`` times; the timed seconds of the last
        ``iters``."""
        x = np.zeros(nbytes // 4, dtype=np.float32)
        times = []
        for _ in range(warmup + iters):
            np.add(x, 1.0, out=x)
            start = time.perf_counter()
            got = ray.get(receiver.take.remote(x))
            times.append(time.perf_counter() - start)
            if got != x.nbytes:
                raise RuntimeError(f"the receiver saw {got} bytes, not {x.nbytes}")
        del x
        return times[warmup:]

    def memory(self, reset: bool) -> dict[str, int]:
        return memory(reset)

    def where(self) -> str:
        return ray.util.get_node_ip_address()


def _wait_for_nodes(count: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if len(alive) >= count:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{len(alive)} Ray node(s) alive after {seconds:.0f} s, need {count}"
            )
        time.sleep(0.2)


def measure(cases: list[tuple[int, int, int]], cross: bool) -> dict[str, Any]:
    if cross:
        sender = Sender.options(resources={"hostA": 1}).remote()
        receiver = Receiver.options(resources={"hostB": 1}).remote()
    else:
        sender, receiver = Sender.remote(), Receiver.remote()
    placement = {
        "sender": ray.get(sender.where.remote()),
        "receiver": ray.get(receiver.where.remote()),
    }
    print(
        f"ray: sender on {placement['sender']}, receiver on {placement['receiver']}",
        file=sys.stderr,
    )
    results: dict[str, Any] = {}
    for nbytes, iters, warmup in cases:
        before = ray.get([sender.memory.remote(True), receiver.memory.remote(True)])
        seconds = ray.get(sender.run.remote(receiver, nbytes, iters, warmup))
        after = ray.get([sender.memory.remote(False), receiver.memory.remote(False)])
        results[str(nbytes)] = {
            "seconds": seconds,
            "sender": {"rss_before": before[0]["rss"], "peak": after[0]["hwm"]},
            "receiver": {"rss_before": before[1]["rss"], "peak": after[1]["hwm"]},
        }
        best = nbytes / min(seconds) / 1e9
        print(f"ray: {nbytes} bytes x {len(seconds)}: best {best:.2f} GB/s", file=sys.stderr)
    return {"cases": results, "placement": placement}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", help="comma list of NBYTES:ITERS:WARMUP")
    parser.add_argument("--address", default=None, help="join this cluster (two nodes, hostA/B)")
    args = parser.parse_args()
    cases = [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",") if c]
    common: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.ERROR}
    if args.address:
        ray.init(address=args.address, **common)
    else:
        ray.init(
            num_cpus=2,
            object_store_memory=OBJECT_STORE_BYTES,
            include_dashboard=False,
            **common,
        )
    try:
        if args.address:
            _wait_for_nodes(2, 60)
        out = measure(cases, cross=bool(args.address))  # type: ignore[arg-type]
    finally:
        ray.shutdown()
    out["_versions"] = {
        "ray": ray.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
