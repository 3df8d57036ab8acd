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
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from orchestr.errors import DescriptorError, StaleDescriptorError, TransportError
from orchestr.fabric import _registry
from orchestr.tasks import TaskOwner

from . import _transport
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
            spans = cmd.get("spans")
            writable = cmd.get("writable", True)
            buf = Buffer(
                data, spans=None if spans is None else [tuple(s) for s in spans], writable=writable
            )
            self.buffers[len(self.buffers)] = (buf, data)
            return {"id": len(self.buffers) - 1, "handle": buf.to_wire()}
        if op == "widen":
            buf = self.buffers[cmd["id"]][0]
            buf.allow([tuple(s) for s in cmd["spans"]])
            return {"handle": buf.to_wire()}
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

        backend = _registry.buffer_transport(scheme)
        if backend is not None and _transport.scoping(backend) is not None:
            passed += await _check_scoped(scheme, owner, register, read)

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
            async with TaskOwner() as reads:
                task = reads.start(_read_until_error(victim, dst, scheme))
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


async def _refused(what: str, move: Awaitable[Any]) -> None:
    try:
        await move
    except DescriptorError:
        return
    raise AssertionError(f"{what} was not refused")


async def _check_scoped(
    scheme: str,
    owner: _Remote | _Local,
    register: Callable[..., Awaitable[tuple[int, Buffer]]],
    read: Callable[..., Awaitable[None]],
) -> list[str]:
    """Scoped buffers: a grant of some spans of the owner's memory reaches those only, to read
    only when read-only; a descriptor that claims more is refused by backends whose owner
    enforces the scope; a grant widens, and a released one is stale while the memory lives
    on."""
    size, spans = 1 << 20, [(4096, 8192), (65536 + 10, 4096)]
    want = pattern(size, 12)
    ans = await owner.handle(
        {"op": "register", "nbytes": size, "seed": 12, "spans": spans, "writable": False}
    )
    rid, grant = ans["id"], Buffer.from_wire(ans["handle"])
    assert grant.spans == spans, f"the grant's spans came back as {grant.spans}"
    for offset, n in spans:
        got = np.zeros(n, np.uint8)
        await read(grant, got, offset=offset)
        assert np.array_equal(got, want[offset : offset + n]), "a granted span read wrong"
    part = np.zeros(100, np.uint8)
    await read(grant, part, offset=4096 + 50)
    outside = (
        ("a read across a span's end", 4096 + 8192 - 8, 16),
        ("a read between the spans", 32768, 16),
        ("a read before the first span", 0, 16),
        ("a read past the last span", 65536 + 10 + 4096, 1),
    )
    dst = np.full(16, 0xAB, np.uint8)
    for what, offset, n in outside:
        await _refused(what, read(grant, dst[:n], offset=offset))
    assert (dst == 0xAB).all(), "a refused read wrote into the destination"
    await _refused(
        "a write through a read-only grant",
        grant.write_from(np.zeros(16, np.uint8), offset=4096, transport=scheme, fallback="error"),
    )
    backend = _registry.buffer_transport(scheme)
    forged = [("a descriptor that drops the scope", _forge(grant, scheme, scope=None))]
    if backend is not None and _transport.scoping(backend) == "owner":  # shm: see _scope
        forged.append(
            ("a descriptor that widens the scope", _forge(grant, scheme, scope=(0, size)))
        )
    for what, fake in forged:
        await _refused(what, read(fake, np.zeros(16, np.uint8), offset=32768))
    got = (await owner.handle({"op": "digest", "id": rid}))["digest"]
    assert got == digest(want), "the owner's memory changed under a read-only grant"
    passed = ["scoped: reads inside only, read-only, forged scopes"]

    ans = await owner.handle({"op": "register", "nbytes": size, "seed": 13, "spans": spans[:1]})
    wid, wgrant = ans["id"], Buffer.from_wire(ans["handle"])
    src = pattern(8192, 14)
    async with asyncio.timeout(30):
        await wgrant.write_from(src, offset=4096, transport=scheme, fallback="error")
    for what, offset in (("a write across the span's end", 4096 + 8192 - 8), ("one past", 0)):
        await _refused(
            what,
            wgrant.write_from(
                np.zeros(16, np.uint8), offset=offset, transport=scheme, fallback="error"
            ),
        )
    wider = Buffer.from_wire(
        (await owner.handle({"op": "widen", "id": wid, "spans": [(0, 64)]}))["handle"]
    )
    head = np.zeros(64, np.uint8)
    await read(wider, head)
    await read(wgrant, np.zeros(8, np.uint8), offset=4096)  # the old handle keeps its spans
    expect = pattern(size, 13)
    expect[4096 : 4096 + 8192] = src
    assert np.array_equal(head, expect[:64]), "a widened span read wrong"
    got = (await owner.handle({"op": "digest", "id": wid}))["digest"]
    assert got == digest(expect), "a write through a grant reached past its span"
    await owner.handle({"op": "release", "id": wid})
    try:
        await read(wider, np.zeros(16, np.uint8))
    except StaleDescriptorError:
        pass
    else:
        raise AssertionError("a released grant could still be read")
    passed.append("scoped: writes inside only, widened, revoked")
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
