"""The one-sided half of the transport conformance suite (see :mod:`orchestr.fabric.testing`).

An owner registers memory and serves commands; the checking process holds only handles and
moves bytes with one backend, under the fallback policy ``error`` so nothing can quietly take
another path. For backends that cross processes the owner is a subprocess (so it can be killed
mid-transfer or stopped past a deadline); for ``inproc`` it lives in this process.

Run as ``python -m orchestr.fabric._buffers._conformance`` to be an owner: JSON commands on
stdin, one JSON answer per line on stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import sys
from typing import Any

import numpy as np

from orchestr.errors import DescriptorError, StaleDescriptorError, TransportError

from ._handle import Buffer

__all__ = ["check_buffer_transport"]

SIZES = (0, 1, 4095, (1 << 20) + 3, 64 << 20)


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def digest(data: Any) -> str:
    return hashlib.blake2b(memoryview(data), digest_size=16).hexdigest()


class _Owner:
    """Owns registered memory and answers commands (in a subprocess or in this process)."""

    def __init__(self) -> None:
        self.buffers: dict[int, tuple[Buffer, Any]] = {}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "register":
            data: Any = pattern(cmd["nbytes"], cmd["seed"])
            if cmd.get("readonly"):
                data = data.tobytes()
            buf = Buffer(data)
            self.buffers[len(self.buffers)] = (buf, data)
            return {"id": len(self.buffers) - 1, "handle": buf.to_wire()}
        if op == "digest":
            return {"digest": digest(self.buffers[cmd["id"]][1])}
        if op == "release":
            self.buffers[cmd["id"]][0].release()
            return {}
        raise ValueError(f"unknown command {op!r}")


def _serve_stdin() -> None:
    owner = _Owner()
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        try:
            answer = owner.handle(json.loads(line))
        except Exception as exc:  # report, keep serving
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)


class _Remote:
    """A subprocess owner."""

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "orchestr.fabric._buffers._conformance",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        hello = await self._line()
        self.pid = hello["ready"]

    async def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        async with asyncio.timeout(30):
            line = await self.proc.stdout.readline()
        if not line:
            raise AssertionError("the owner process exited")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise AssertionError(f"owner: {answer['error']}")
        return answer

    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        await self.proc.stdin.drain()
        return await self._line()

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()


class _Local:
    def __init__(self) -> None:
        self.owner = _Owner()
        self.pid = os.getpid()

    async def start(self) -> None:
        pass

    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return self.owner.handle(cmd)

    async def kill(self) -> None:
        for buf, _ in self.owner.buffers.values():
            buf.release()


def _forge(buf: Buffer, scheme: str, **changes: Any) -> Buffer:
    forged = dataclasses.replace(buf.descriptors[scheme], **changes)
    return Buffer._from_parts(forged.length, buf.dtype, [forged.length], {scheme: forged})


async def check_buffer_transport(scheme: str) -> list[str]:
    """Run every one-sided check against backend ``scheme``; returns the names passed.

    Blocks on owner processes it starts and the transfers; raises AssertionError naming the
    check that failed. Cancel-safe: the owners are stopped however it ends."""
    passed: list[str] = []
    owner: _Remote | _Local = _Local() if scheme == "inproc" else _Remote()
    await owner.start()
    try:

        async def register(nbytes: int, seed: int, readonly: bool = False) -> tuple[int, Buffer]:
            ans = await owner.handle(
                {"op": "register", "nbytes": nbytes, "seed": seed, "readonly": readonly}
            )
            return ans["id"], Buffer.from_wire(ans["handle"])

        async def read(buf: Buffer, dst: Any, offset: int = 0) -> None:
            async with asyncio.timeout(60):
                used = await buf.read_into(dst, offset=offset, transport=scheme, fallback="error")
            assert used == scheme, f"asked for {scheme}, moved by {used}"

        # sizes, zero-length included, whole and partial
        for i, n in enumerate(SIZES):
            _, buf = await register(n, i)
            dst = np.zeros(n, np.uint8)
            await read(buf, dst)
            assert digest(dst) == digest(pattern(n, i)), f"{n}-byte read returned wrong bytes"
            if n > 8:
                part = np.zeros(n // 2, np.uint8)
                await read(buf, part, offset=n // 4)
                want = pattern(n, i)[n // 4 : n // 4 + n // 2]
                assert np.array_equal(part, want), f"partial read of {n} bytes wrong"
        passed.append("read sizes")

        rid, buf = await register(1 << 20, 7)
        src = pattern(4096 + 5, 8)
        async with asyncio.timeout(30):
            await buf.write_from(src, offset=1000, transport=scheme, fallback="error")
        want = pattern(1 << 20, 7)
        want[1000 : 1000 + src.size] = src
        got = (await owner.handle({"op": "digest", "id": rid}))["digest"]
        assert got == digest(want), "write_from did not land in the owner's memory"
        passed.append("write")

        dst = np.full(64, 0xAB, np.uint8)
        for offset in ((1 << 20) - 32, -1, 1 << 40):
            try:
                await read(buf, dst, offset=offset)
            except DescriptorError:
                pass
            else:
                raise AssertionError(f"a read at offset {offset} past the end succeeded")
        assert (dst == 0xAB).all(), "a refused read wrote into the destination"
        passed.append("out of bounds")

        for label, forged in (
            ("wrong length", _forge(buf, scheme, length=(1 << 20) + 4096)),
            ("forged key", _forge(buf, scheme, key=buf.descriptors[scheme].key ^ 0x5A5A)),
            ("forged region", _forge(buf, scheme, region=buf.descriptors[scheme].region + 999)),
        ):
            big = np.zeros(forged.nbytes, np.uint8)
            try:
                await read(forged, big)
            except DescriptorError:
                pass
            else:
                raise AssertionError(f"a descriptor with a {label} was accepted")
        if scheme == "shm":
            pid, _, table_key, slot = buf.descriptors[scheme].where
            for where in ((pid, 0, table_key, slot), (pid, 1, table_key, slot), (1, 3, 9, 0)):
                try:
                    await read(_forge(buf, scheme, where=where), np.zeros(16, np.uint8))
                except DescriptorError:
                    pass
                else:
                    raise AssertionError(f"a forged shm location {where} was accepted")
        passed.append("forged descriptors")

        ro_id, ro = await register(8192, 9, readonly=True)
        try:
            await ro.write_from(np.zeros(16, np.uint8), transport=scheme, fallback="error")
        except DescriptorError:
            pass
        else:
            raise AssertionError("a write into a read-only buffer succeeded")
        got = (await owner.handle({"op": "digest", "id": ro_id}))["digest"]
        assert got == digest(pattern(8192, 9)), "a refused write changed the buffer"
        passed.append("read-only")

        await owner.handle({"op": "release", "id": rid})
        try:
            await read(buf, np.zeros(16, np.uint8))
        except StaleDescriptorError:
            pass
        else:
            raise AssertionError("a released buffer could still be read")
        passed.append("stale after release")

        if isinstance(owner, _Remote):
            _, slow = await register(8 << 20, 10)
            os.kill(owner.pid, signal.SIGSTOP)
            try:
                async with asyncio.timeout(0.5):
                    await slow.read_into(np.zeros(8 << 20, np.uint8), transport=scheme)
                outcome = "completed (one-sided: the owner took no part)"
            except TimeoutError:
                outcome = "timed out"
            finally:
                os.kill(owner.pid, signal.SIGCONT)
            passed.append(f"deadline: {outcome}")

            _, victim = await register(256 << 20, 11)
            dst = np.zeros(256 << 20, np.uint8)
            task = asyncio.ensure_future(_read_until_error(victim, dst, scheme))
            await asyncio.sleep(0.05)
            await owner.kill()
            async with asyncio.timeout(20):
                err = await task
            assert isinstance(err, TransportError), f"after SIGKILL a read raised {err!r}"
            passed.append("owner killed mid-transfer")
        else:
            passed.append("deadline (in-process: nothing can stall)")
    finally:
        await owner.kill()
    return passed


async def _read_until_error(buf: Buffer, dst: Any, scheme: str) -> BaseException:
    for _ in range(10_000):
        try:
            await buf.read_into(dst, transport=scheme, fallback="error")
        except Exception as exc:
            return exc
    raise AssertionError("reads kept succeeding after the owner was killed")


if __name__ == "__main__":
    _serve_stdin()
