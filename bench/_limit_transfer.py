"""The limits for moving a large float32 tensor between two processes on this machine.

- ``memcpy``: ``np.copyto`` from a freshly refreshed array into a pre-faulted one, one process.
- ``shm``: the best a shared-memory path can do. The writer copies the refreshed array into a
  reused, pre-faulted segment of ``/dev/shm`` (a file it mmaps), signals a second process over a
  pipe, which builds a zero-copy numpy view of the segment (``np.frombuffer``) and answers one
  byte. Timed from the start of the copy to the answer.
- ``socket``: a raw TCP stream between two processes: ``sendall`` of the array's memoryview,
  ``recv_into`` a pre-faulted buffer, one byte back. On loopback, or to a ``sink`` started in
  another network namespace (``--connect HOST:PORT``).

The source array is refreshed (``+= 1``) before every transfer, outside the timed part, so each
transfer moves new data. Each mode prints one JSON line ``{"nbytes": N, "seconds": [...]}``
with the timed iterations (warm-up ones dropped)::

    python bench/_limit_transfer.py memcpy NBYTES ITERS
    python bench/_limit_transfer.py shm NBYTES ITERS
    python bench/_limit_transfer.py socket NBYTES ITERS [--connect HOST:PORT]
    python bench/_limit_transfer.py sink [--host HOST]     # prints its port, serves one peer
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import struct
import subprocess
import sys
import time

import numpy as np

WARMUP = 2
_HEAD = struct.Struct("<Q")


def _fresh(nbytes: int) -> np.ndarray:
    return np.full(nbytes // 4, 1.0, dtype=np.float32)


def memcpy(nbytes: int, iters: int) -> list[float]:
    src = _fresh(nbytes)
    dst = np.zeros_like(src)  # zeros_like writes the pages: pre-faulted
    dst.fill(0.0)
    times = []
    for _ in range(WARMUP + iters):
        src += 1.0
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return times[WARMUP:]


def shm(nbytes: int, iters: int) -> list[float]:
    path = f"/dev/shm/orchestr-limit-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    reader = None
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as segment:
            seg = np.frombuffer(segment, dtype=np.float32)
            seg.fill(0.0)  # pre-fault the segment once
            src = _fresh(nbytes)
            reader = subprocess.Popen(
                [sys.executable, __file__, "shm-reader", path, str(nbytes)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                bufsize=0,
            )
            assert reader.stdin is not None and reader.stdout is not None
            if reader.stdout.read(1) != b"r":
                raise RuntimeError("the shm reader did not start")
            times = []
            for _ in range(WARMUP + iters):
                src += 1.0
                start = time.perf_counter()
                np.copyto(seg, src)
                reader.stdin.write(b"g")
                if reader.stdout.read(1) != b"k":
                    raise RuntimeError("the shm reader went away")
                times.append(time.perf_counter() - start)
            del seg
            reader.stdin.close()
            reader.wait(timeout=30)
            return times[WARMUP:]
    finally:
        if reader is not None and reader.poll() is None:
            reader.kill()
            reader.wait()
        os.close(fd)
        os.unlink(path)


def shm_reader(path: str, nbytes: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    with mmap.mmap(fd, nbytes, prot=mmap.PROT_READ) as segment:
        os.close(fd)
        out, inp = sys.stdout.buffer, sys.stdin.buffer
        out.write(b"r")
        out.flush()
        while inp.read(1) == b"g":
            view = np.frombuffer(segment, dtype=np.float32)  # zero-copy: no page is touched
            if view.nbytes != nbytes:
                raise RuntimeError("short segment")
            del view
            out.write(b"k")
            out.flush()


def sink(host: str) -> None:
    """Accept one connection; per message read ``u64 n`` and ``n`` bytes into a reused,
    pre-faulted buffer, then answer one byte."""
    with socket.create_server((host, 0)) as server:
        print(server.getsockname()[1], flush=True)
        conn, _ = server.accept()
        with conn:
            buf = np.zeros(0, dtype=np.uint8)
            while True:
                head = conn.recv(_HEAD.size, socket.MSG_WAITALL)
                if len(head) < _HEAD.size:
                    return
                (size,) = _HEAD.unpack(head)
                if buf.nbytes < size:
                    buf = np.zeros(size, dtype=np.uint8)
                    buf.fill(0)
                view = memoryview(buf)[:size]
                got = 0
                while got < size:
                    n = conn.recv_into(view[got:], size - got)
                    if n == 0:
                        return
                    got += n
                conn.sendall(b"k")


def stream(nbytes: int, iters: int, connect: str | None) -> list[float]:
    proc = None
    if connect is None:
        proc = subprocess.Popen(
            [sys.executable, __file__, "sink"], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None
        address = ("127.0.0.1", int(proc.stdout.readline()))
    else:
        host, _, port = connect.rpartition(":")
        address = (host, int(port))
    try:
        src = _fresh(nbytes)
        data = memoryview(src).cast("B")
        with socket.create_connection(address, timeout=120) as sock:
            times = []
            for _ in range(WARMUP + iters):
                src += 1.0
                start = time.perf_counter()
                sock.sendall(_HEAD.pack(nbytes))
                sock.sendall(data)
                if sock.recv(1) != b"k":
                    raise RuntimeError("the sink went away")
                times.append(time.perf_counter() - start)
        return times[WARMUP:]
    finally:
        if proc is not None:
            proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["memcpy", "shm", "socket", "sink", "shm-reader"])
    parser.add_argument("args", nargs="*")
    parser.add_argument("--connect", default=None, metavar="HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1")
    ns = parser.parse_args()
    if ns.mode == "sink":
        sink(ns.host)
        return
    if ns.mode == "shm-reader":
        shm_reader(ns.args[0], int(ns.args[1]))
        return
    nbytes, iters = int(ns.args[0]), int(ns.args[1])
    if ns.mode == "memcpy":
        seconds = memcpy(nbytes, iters)
    elif ns.mode == "shm":
        seconds = shm(nbytes, iters)
    else:
        seconds = stream(nbytes, iters, ns.connect)
    print(json.dumps({"nbytes": nbytes, "seconds": seconds}))


if __name__ == "__main__":
    main()
