"""Weight sync, trainer actor to generator actor, the Ray way: the peer half of
``bench/rl_throughput.py``.

Run with the Ray transfer venv's interpreter (``ray==2.60.0`` and numpy; see
``bench/_venvs.py``)::

    bench/.venvs/ray-transfer/bin/python bench/peers/ray_weightsync.py MODELS_JSON

``MODELS_JSON`` is a file ``{"models": {NAME: {"tensors": [[name, dtype, shape], ...],
"iters": N, "warmup": W}, ...}}``: the state dict of each model the orchestr side syncs (no
torch here, so numpy arrays of the same dtypes and shapes stand in for it). Ray starts locally
(``num_cpus=2``, a 1 GiB object store, no dashboard); both actors share the host.

Per model, a ``Trainer`` actor holds the state (a dict of numpy arrays) and a ``Generator``
actor holds preallocated, pre-faulted arrays of the same shapes. Per iteration:

1. ``trainer.step()`` (untimed) changes every array in place (``+= 1``), standing in for an
   optimizer step, so each sync moves new values;
2. ``trainer.publish()`` does ``ray.put(state)`` (the state goes into the object store; the
   trainer keeps the newest ref alive, so the object lives until the next publish) and returns
   the ref wrapped in a list, so Ray passes it on without resolving it;
3. ``generator.sync(refs)`` does ``ray.get`` of the state (zero-copy read-only views of the
   object store on one host) and ``np.copyto`` into its own arrays, and returns the seconds
   that took, measured inside the actor: the figure comparable to orchestr's
   ``Generator.sync_weights`` report.

The driver also times ``publish`` and publish + sync end to end. Warm-up iterations run first.

Progress goes to stderr; the last line of stdout is one JSON object:
``{"models": {NAME: {"seconds": [...], "publish_seconds": [...], "round_trip_seconds": [...],
"bytes": B, "tensors": T}}, "_versions": {...}}``.
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

OBJECT_STORE_BYTES = 1 << 30

TensorSpec = tuple[str, str, list[int]]  # name, numpy dtype, shape


def _arrays(tensors: list[TensorSpec], fill: float) -> dict[str, np.ndarray]:
    """Arrays of the given dtypes and shapes, every page written (pre-faulted)."""
    return {name: np.full(shape, fill, dtype=np.dtype(dtype)) for name, dtype, shape in tensors}


@ray.remote
class Trainer:
    def __init__(self, tensors: list[TensorSpec]) -> None:
        self.state = _arrays(tensors, 0.5)
        self.latest: ray.ObjectRef[Any] | None = None

    def step(self) -> None:
        """Change every array in place: what an optimizer step does to the weights."""
        for a in self.state.values():
            np.add(a, 1.0, out=a)

    def publish(self) -> list[ray.ObjectRef[Any]]:
        """Put the state into the object store; the ref comes back in a list, unresolved."""
        self.latest = ray.put(self.state)
        return [self.latest]


@ray.remote
class Generator:
    def __init__(self, tensors: list[TensorSpec]) -> None:
        self.state = _arrays(tensors, 0.0)

    def sync(self, refs: list[ray.ObjectRef[Any]]) -> float:
        """Fetch the published state and copy it into this actor's arrays; the seconds it took."""
        start = time.perf_counter()
        state = ray.get(refs[0])
        for name, dst in self.state.items():
            np.copyto(dst, state[name])
        del state
        return time.perf_counter() - start

    def checksum(self) -> float:
        return float(sum(float(a.sum(dtype=np.float64)) for a in self.state.values()))


def measure(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    tensors: list[TensorSpec] = [(n, d, list(s)) for n, d, s in spec["tensors"]]
    iters, warmup = int(spec["iters"]), int(spec["warmup"])
    nbytes = sum(int(np.prod(s)) * np.dtype(d).itemsize for _, d, s in tensors)
    trainer = Trainer.remote(tensors)
    generator = Generator.remote(tensors)
    seconds, publish, round_trip = [], [], []
    for _ in range(warmup + iters):
        ray.get(trainer.step.remote())
        start = time.perf_counter()
        refs = ray.get(trainer.publish.remote())
        published = time.perf_counter()
        seconds.append(ray.get(generator.sync.remote(refs)))
        round_trip.append(time.perf_counter() - start)
        publish.append(published - start)
    # every element was 0.5 + (warmup + iters) after the last step; the generator must hold it
    want = sum(int(np.prod(s)) for _, _, s in tensors) * (0.5 + warmup + iters)
    got = ray.get(generator.checksum.remote())
    if abs(got - want) > 1e-6 * want:
        raise RuntimeError(f"{name}: the generator holds sum {got}, expected {want}")
    ray.kill(trainer)
    ray.kill(generator)
    med = sorted(seconds[warmup:])[len(seconds[warmup:]) // 2]
    print(
        f"ray: {name}: {nbytes / 1e6:.2f} MB in {len(tensors)} arrays, sync {med * 1e3:.2f} ms "
        f"(median of {iters})",
        file=sys.stderr,
        flush=True,
    )
    return {
        "seconds": seconds[warmup:],
        "publish_seconds": publish[warmup:],
        "round_trip_seconds": round_trip[warmup:],
        "bytes": nbytes,
        "tensors": len(tensors),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", help="JSON file: {'models': {name: {tensors, iters, warmup}}}")
    args = parser.parse_args()
    with open(args.models) as f:
        models: dict[str, dict[str, Any]] = json.load(f)["models"]
    ray.init(
        num_cpus=2,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
    )
    try:
        out: dict[str, Any] = {"models": {n: measure(n, spec) for n, spec in models.items()}}
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
