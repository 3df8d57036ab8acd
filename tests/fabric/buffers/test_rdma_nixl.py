"""The ``rdma`` (pyverbs) and ``nixl`` buffer backends: discovery, the reasons they give when
they cannot work, and their data paths where this machine can run them."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from orchestr.errors import DescriptorError, StaleDescriptorError, TransportUnavailableError
from orchestr.fabric import _local, _registry
from orchestr.fabric._buffers import _nixl, _rdma, _rdma_devices, _scope
from orchestr.fabric._buffers import _transport as _buffers
from orchestr.fabric._buffers._transport import Descriptor

DEBIAN_PYVERBS = os.path.join(_rdma_devices.SYSTEM_DIR, "pyverbs")


def _fake_host(*devices: tuple[str, str]) -> dict[str, Any]:
    """A discovery result with one single-port device per ``(name, port state)``."""
    return {
        "pyverbs": "/somewhere/pyverbs",
        "devices": [
            {
                "name": name,
                "node_guid": "0002:c903:0000:0001",
                "ports": [
                    {
                        "port": 1,
                        "state": state,
                        "link_layer": "Ethernet",
                        "active_mtu": 1024,
                        "gid0": "fe80:0000:0000:0000:0202:c9ff:fe00:0001",
                    }
                ],
            }
            for name, state in devices
        ],
        "error": None,
    }


def _report_row(monkeypatch: pytest.MonkeyPatch, scheme: str, backend: Any) -> dict[str, Any]:
    monkeypatch.setattr(_registry, "_instances", {})
    monkeypatch.setattr(_registry, "_factories", {scheme: lambda: backend})
    rows = {row["scheme"]: row for row in _registry.transport_report()}
    return rows[scheme]


# -- rdma: discovery and reasons -------------------------------------------------------------


def test_system_pyverbs_is_loaded_alone_without_touching_sys_path() -> None:
    if not os.path.isdir(DEBIAN_PYVERBS):
        pytest.skip(f"no Debian python3-pyverbs at {DEBIAN_PYVERBS}")
    code = (
        "import sys\n"
        "before = list(sys.path)\n"
        "from orchestr.fabric._buffers import _rdma_devices\n"
        "pv = _rdma_devices.load_pyverbs()\n"
        "import pyverbs.device\n"
        "print(pv.__file__, sys.path == before, pyverbs.device.__file__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    init, same_path, device = out.stdout.split()
    if not init.startswith(DEBIAN_PYVERBS):
        pytest.skip(f"this interpreter has its own pyverbs ({init})")
    assert same_path == "True"
    assert device.startswith(DEBIAN_PYVERBS) and device.endswith(".so")


def test_pyverbs_without_a_device_says_so() -> None:
    info = _rdma_devices.discover()
    if info["pyverbs"] is None:
        pytest.skip(f"pyverbs is not available here: {info['error']}")
    if info["devices"]:
        pytest.skip(f"this host has RDMA devices: {[d['name'] for d in info['devices']]}")
    assert info["error"]  # pyverbs's own words, e.g. "Failed to get devices list"
    backend = _rdma.RdmaBuffers()
    reason = backend.probe()
    assert reason == f"pyverbs found but no RDMA device: {info['error']}"
    assert backend.details() == {"devices": [], "pyverbs": info["pyverbs"]}


def test_missing_pyverbs_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_rdma_devices, "load_pyverbs", lambda: None)
    monkeypatch.setattr(_rdma_devices, "load_problem", None)
    backend = _rdma.RdmaBuffers()
    assert backend.probe() == _rdma_devices.NOT_INSTALLED
    assert "apt install python3-pyverbs" in _rdma_devices.NOT_INSTALLED
    assert backend.details() == {"devices": [], "pyverbs": None}
    region = _buffers.Region(1, memoryview(bytearray(8)))
    with pytest.raises(TransportUnavailableError, match="pyverbs is not installed"):
        backend.export(region)


@pytest.mark.parametrize(
    ("devices", "wanted", "expected"),
    [
        (
            [("mlx5_0", "ACTIVE")],
            "mlx5_9",
            "ORCHESTR_RDMA_DEVICE=mlx5_9 names a device that is not here (devices: mlx5_0)",
        ),
        ([("mlx5_0", "DOWN")], None, "no RDMA port is ACTIVE (devices: mlx5_0)"),
        (
            [("mlx5_0", "ACTIVE"), ("mlx5_1", "DOWN")],
            "mlx5_1",
            "no RDMA port is ACTIVE (devices: mlx5_1)",
        ),
        (
            [],
            "mlx5_0",
            "pyverbs found but no RDMA device: Failed to get devices list "
            "(ORCHESTR_RDMA_DEVICE=mlx5_0 was asked for)",
        ),
    ],
)
def test_device_selection_explains_why_not(
    monkeypatch: pytest.MonkeyPatch,
    devices: list[tuple[str, str]],
    wanted: str | None,
    expected: str,
) -> None:
    info = _fake_host(*devices)
    if not devices:
        info["error"] = "Failed to get devices list"
    monkeypatch.setattr(_rdma_devices, "discover", lambda: info)
    if wanted is None:
        monkeypatch.delenv(_rdma_devices.DEVICE_ENV, raising=False)
    else:
        monkeypatch.setenv(_rdma_devices.DEVICE_ENV, wanted)
    assert _rdma.RdmaBuffers().probe() == expected


def test_device_selection_picks_the_named_active_port(monkeypatch: pytest.MonkeyPatch) -> None:
    info = _fake_host(("mlx5_0", "DOWN"), ("mlx5_1", "ACTIVE"), ("mlx5_2", "ACTIVE"))
    monkeypatch.setattr(_rdma_devices, "discover", lambda: info)
    monkeypatch.delenv(_rdma_devices.DEVICE_ENV, raising=False)
    assert _rdma_devices.select_port(info) == ("mlx5_1", 1)
    monkeypatch.setenv(_rdma_devices.DEVICE_ENV, "mlx5_2")
    assert _rdma_devices.select_port(info) == ("mlx5_2", 1)
    backend = _rdma.RdmaBuffers()
    assert backend.probe() is None
    assert backend.details()["devices"] == ["mlx5_0", "mlx5_1", "mlx5_2"]


def test_report_row_for_rdma_carries_reason_and_details(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_rdma_devices, "load_pyverbs", lambda: None)
    monkeypatch.setattr(_rdma_devices, "load_problem", None)
    row = _report_row(monkeypatch, "rdma", _rdma.RdmaBuffers())
    assert row["available"] is False
    assert row["reason"] == _rdma_devices.NOT_INSTALLED
    assert row["devices"] == [] and row["pyverbs"] is None


def test_report_row_for_rdma_on_this_host(monkeypatch: pytest.MonkeyPatch) -> None:
    info = _rdma_devices.discover()
    row = _report_row(monkeypatch, "rdma", _rdma.RdmaBuffers())
    assert row["pyverbs"] == info["pyverbs"]
    assert row["devices"] == [d["name"] for d in info["devices"]]
    try:
        _rdma_devices.select_port(info)
    except TransportUnavailableError as exc:
        assert row["available"] is False and row["reason"] == str(exc)
    else:
        assert row["available"] is True and "reason" not in row


async def test_rdma_rejects_malformed_descriptors_before_touching_a_device() -> None:
    backend = _rdma.RdmaBuffers()
    key = _local.process_key()
    bad = Descriptor("rdma", key, 1, 1, 16, ("127.0.0.1", "port", 0, 0))
    with pytest.raises(DescriptorError, match="malformed rdma descriptor"):
        await backend.read_into(bad, 0, memoryview(bytearray(4)))
    good = Descriptor("rdma", key, 1, 1, 16, ("127.0.0.1", 1, 4096, 7))
    with pytest.raises(DescriptorError, match="lies outside"):
        await backend.read_into(good, 8, memoryview(bytearray(16)))
    with pytest.raises(ValueError, match="writable"):
        await backend.read_into(good, 0, memoryview(b"abcd"))


# -- rdma: the data path, where a device with an active port exists ------------------------------


async def test_rdma_data_path() -> None:
    info = _rdma_devices.discover()
    try:
        _rdma_devices.select_port(info)
    except TransportUnavailableError as exc:
        pytest.skip(f"RDMA data path not run: {exc}")
    backend = _rdma.RdmaBuffers()
    data = np.arange(1 << 16, dtype=np.uint32)
    region = _buffers.register_memory(memoryview(data).cast("B"), [backend])
    try:
        desc = region.descriptor("rdma")
        dst = np.zeros_like(data)
        await backend.read_into(desc, 0, memoryview(dst).cast("B"))
        assert np.array_equal(dst, data)
        part = bytearray(12)
        await backend.read_into(desc, 40, memoryview(part))
        assert np.frombuffer(part, np.uint32).tolist() == [10, 11, 12]
        await backend.write_from(desc, 4, memoryview(np.array([7, 8], np.uint32)).cast("B"))
        assert data[:4].tolist() == [0, 7, 8, 3]
        # a scoped registration of the same memory: its spans only, read-only
        scope = _scope.flatten([(4096, 64), (8192, 64)], data.nbytes)
        grant = _buffers.register_memory(memoryview(data).cast("B").toreadonly(), [backend], scope)
        try:
            gdesc = grant.descriptor("rdma")
            two = bytearray(8)
            await backend.read_into(gdesc, 8192, memoryview(two))
            assert np.frombuffer(two, np.uint32).tolist() == [2048, 2049]
            for offset in (0, 4096 + 60, 6000):
                with pytest.raises(DescriptorError):
                    await backend.read_into(gdesc, offset, memoryview(bytearray(8)))
            with pytest.raises(DescriptorError, match="read-only"):
                await backend.write_from(gdesc, 4096, memoryview(b"xx"))
        finally:
            _buffers.release(grant, [backend])
    finally:
        _buffers.release(region, [backend])
    with pytest.raises(StaleDescriptorError):
        await backend.read_into(desc, 0, memoryview(bytearray(8)))
    backend.close()


# -- rdma: the backend's own flow against an in-memory stand-in for the verbs ------------------


class _Bag:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.__dict__.update(kwargs)

    def close(self) -> None:
        self.closed = True


class _FakeVerbs:
    """Just enough of pyverbs for RdmaBuffers: MRs are address ranges checked by rkey, and an
    RDMA work request is a memmove between them, completed on the poster's CQ."""

    REM_ACCESS_ERR, LOCAL_WRITE, REMOTE_WRITE, REMOTE_READ = 10, 1, 2, 4

    def __init__(self) -> None:
        import ctypes
        import types

        self.memmove = ctypes.memmove
        self.mrs: dict[int, Any] = {}
        self.qps: dict[int, Any] = {}
        self.posted = 0
        fake = self
        e = types.SimpleNamespace(
            IBV_LINK_LAYER_ETHERNET=2,
            IBV_GID_TYPE_SYSFS_ROCE_V2=1,
            IBV_QPT_RC=2,
            IBV_ACCESS_LOCAL_WRITE=1,
            IBV_ACCESS_REMOTE_WRITE=2,
            IBV_ACCESS_REMOTE_READ=4,
            IBV_WR_RDMA_WRITE=0,
            IBV_WR_RDMA_READ=4,
            IBV_SEND_SIGNALED=2,
            IBV_WC_SUCCESS=0,
            IBV_WC_REM_ACCESS_ERR=10,
        )

        class Context(_Bag):
            def query_port(self, port: int) -> Any:
                return _Bag(lid=7, active_mtu=3, link_layer=1, gid_tbl_len=1, state=4)

            def query_gid(self, port: int, index: int) -> str:
                return "fe80:0000:0000:0000:0202:c9ff:fe00:0001"

        class CQ(_Bag):
            def __init__(self, *args: Any) -> None:
                super().__init__(*args)
                self.done: list[Any] = []

            def poll(self) -> tuple[int, list[Any]]:
                done, self.done = self.done[:1], self.done[1:]
                return len(done), done

        class MR(_Bag):
            def __init__(self, pd: Any, length: int, access: int, address: int) -> None:
                super().__init__(length=length, access=access, address=address)
                self.lkey = self.rkey = 0x100 + len(fake.mrs)
                fake.mrs[self.rkey] = self

        class QP(_Bag):
            def __init__(self, pd: Any, init: Any) -> None:
                super().__init__(init=init, qp_num=len(fake.qps) + 1)
                fake.qps[self.qp_num] = self  # type: ignore[attr-defined]

            def to_rts(self, attr: Any) -> None:
                self.peer = attr.dest_qp_num

            def post_send(self, wr: Any) -> None:
                fake.posted += 1
                sge, mr = wr.sg[0], fake.mrs.get(wr.rkey)
                need = fake.REMOTE_WRITE if wr.opcode == 0 else fake.REMOTE_READ
                ok = (
                    mr is not None
                    and not getattr(mr, "closed", False)
                    and mr.access & need
                    and mr.address <= wr.raddr
                    and wr.raddr + sge.length <= mr.address + mr.length
                )
                if ok:
                    src, dst = (sge.addr, wr.raddr) if wr.opcode == 0 else (wr.raddr, sge.addr)
                    fake.memmove(dst, src, sge.length)
                status = 0 if ok else fake.REM_ACCESS_ERR
                self.init.scq.done.append(_Bag(status=status, wr_id=wr.wr_id))  # type: ignore[attr-defined]

        class SendWR(_Bag):
            def set_wr_rdma(self, rkey: int, addr: int) -> None:
                self.rkey, self.raddr = rkey, addr

        def sge(addr: int, length: int, lkey: int) -> Any:
            return _Bag(addr=addr, length=length, lkey=lkey)

        self.modules = {
            "enums": e,
            "device": types.SimpleNamespace(Context=Context),
            "pd": types.SimpleNamespace(PD=_Bag),
            "cq": types.SimpleNamespace(CQ=CQ),
            "mr": types.SimpleNamespace(MR=MR),
            "qp": types.SimpleNamespace(QP=QP, QPCap=_Bag, QPInitAttr=_Bag, QPAttr=_Bag),
            "addr": types.SimpleNamespace(GID=_Bag, GlobalRoute=_Bag, AHAttr=_Bag),
            "wr": types.SimpleNamespace(SGE=sge, SendWR=SendWR),
        }


async def test_rdma_flow_against_stand_in_verbs(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeVerbs()
    monkeypatch.setattr(_rdma_devices, "submodule", lambda name: fake.modules[name])
    monkeypatch.setattr(_rdma_devices, "discover", lambda: _fake_host(("fake0", "ACTIVE")))
    monkeypatch.delenv(_rdma_devices.DEVICE_ENV, raising=False)
    owner, reader = _rdma.RdmaBuffers(), _rdma.RdmaBuffers()
    data = np.arange(4096, dtype=np.uint32)
    region = _buffers.register_memory(memoryview(data).cast("B"), [owner])
    frozen = _buffers.register_memory(memoryview(bytes(range(64))), [owner])
    try:
        desc = region.descriptor("rdma")
        host, port, addr, rkey = desc.where
        assert addr == data.ctypes.data and isinstance(port, int)
        dst = np.zeros_like(data)
        await reader.read_into(desc, 0, memoryview(dst).cast("B"))
        assert np.array_equal(dst, data)
        part = bytearray(8)
        await reader.read_into(desc, 16, memoryview(part))
        assert np.frombuffer(part, np.uint32).tolist() == [4, 5]
        await reader.write_from(desc, 4, memoryview(np.array([70, 80], np.uint32)).cast("B"))
        assert data[:4].tolist() == [0, 70, 80, 3]
        posted = fake.posted
        for forged in (
            dataclasses.replace(desc, key=desc.key ^ 0x5A5A),
            dataclasses.replace(desc, region=desc.region + 999),
            dataclasses.replace(desc, length=desc.length + 4096),
            dataclasses.replace(desc, where=(host, port, addr, rkey + 1)),
        ):
            with pytest.raises(DescriptorError):
                await reader.read_into(forged, 0, memoryview(bytearray(16)))
        assert fake.posted == posted, "a forged descriptor reached the adapter"
        ro = frozen.descriptor("rdma")
        got = bytearray(64)
        await reader.read_into(ro, 0, memoryview(got))
        assert got == bytes(range(64))
        with pytest.raises(DescriptorError, match="read-only"):
            await reader.write_from(ro, 0, memoryview(b"xx"))
    finally:
        _buffers.release(region, [owner])
        _buffers.release(frozen, [owner])
    with pytest.raises(StaleDescriptorError, match="refused remote access"):
        await reader.read_into(desc, 0, memoryview(bytearray(8)))
    with pytest.raises(StaleDescriptorError, match="not registered there"):
        await reader.read_into(desc, 0, memoryview(bytearray(8)))  # a new QP asks afresh
    assert _buffers.stats["rdma"].bytes_read >= data.nbytes + 8 + 64
    reader.close()
    owner.close()


async def test_a_scoped_rdma_region_has_an_mr_per_span_and_none_over_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _FakeVerbs()
    monkeypatch.setattr(_rdma_devices, "submodule", lambda name: fake.modules[name])
    monkeypatch.setattr(_rdma_devices, "discover", lambda: _fake_host(("fake0", "ACTIVE")))
    monkeypatch.delenv(_rdma_devices.DEVICE_ENV, raising=False)
    owner, reader = _rdma.RdmaBuffers(), _rdma.RdmaBuffers()
    data = np.arange(4096, dtype=np.uint32)  # 16 KiB
    base = data.ctypes.data
    scope = _scope.flatten([(1024, 512), (1536, 512), (8192, 256)], data.nbytes)
    region = _buffers.register_memory(memoryview(data).cast("B").toreadonly(), [owner], scope)
    try:
        mrs = {(mr.address - base, mr.length) for mr in fake.mrs.values()}
        assert mrs == {(1024, 1024), (8192, 256)}  # one per span (touching ones merged)
        desc = region.descriptor("rdma")
        assert desc.where[3] == 0 and desc.scope == (1024, 2048, 8192, 8448)
        got = np.zeros(256, np.uint32)
        await reader.read_into(desc, 1024, memoryview(got).cast("B"))
        assert got.tolist() == list(range(256, 512))
        posted = fake.posted
        forged = [
            dataclasses.replace(desc, scope=None),
            dataclasses.replace(desc, scope=(0, data.nbytes)),
        ]
        for offset, fake_desc in ((0, forged[0]), (4096, forged[1]), (2040, forged[1])):
            with pytest.raises(DescriptorError, match="spans|forged"):
                await reader.read_into(fake_desc, offset, memoryview(bytearray(16)))
        with pytest.raises(DescriptorError, match="read-only"):
            await reader.write_from(desc, 1024, memoryview(b"xx"))
        assert fake.posted == posted, "a transfer outside the spans reached the adapter"
        # past orchestr's checks, the adapter itself: a span's rkey does not reach beyond it
        span_mr = next(mr for mr in fake.mrs.values() if mr.address == base + 1024)
        wr = fake.modules["wr"].SendWR(
            wr_id=0, opcode=4, sg=[_Bag(addr=got.ctypes.data, length=16)]
        )
        wr.set_wr_rdma(span_mr.rkey, base + 4096)
        qp = next(iter(fake.qps.values()))
        qp.post_send(wr)
        assert qp.init.scq.done.pop().status == fake.REM_ACCESS_ERR
        # widened: an MR over the new bytes only, and the reader asks again when it needs them
        added = _scope.widen(region.scope or (), [(0, 1100)], data.nbytes)
        _buffers.widen(region, added, [owner])
        assert (0, 1024) in {(mr.address - base, mr.length) for mr in fake.mrs.values()}
        whole = np.zeros(2048 // 4, np.uint32)
        await reader.read_into(region.descriptor("rdma"), 0, memoryview(whole).cast("B"))
        assert whole.tolist() == list(range(512))  # across two MRs: two work requests
    finally:
        _buffers.release(region, [owner])
    assert all(getattr(mr, "closed", False) for mr in fake.mrs.values())
    reader.close()
    owner.close()


# -- nixl ------------------------------------------------------------------------------------


def test_missing_nixl_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_nixl, "load_nixl", lambda: None)
    backend = _nixl.NixlBuffers()
    assert backend.probe() == "the nixl package is not installed (pip install 'orchestr[nixl]')"
    assert backend.details() == {"nixl": None, "agent": None}
    region = _buffers.Region(1, memoryview(bytearray(8)))
    with pytest.raises(TransportUnavailableError, match="nixl package is not installed"):
        backend.export(region)
    row = _report_row(monkeypatch, "nixl", backend)
    assert row["available"] is False
    assert row["reason"] == _nixl.NOT_INSTALLED
    assert row["nixl"] is None


async def test_nixl_rejects_malformed_descriptors() -> None:
    backend = _nixl.NixlBuffers()
    bad = Descriptor("nixl", _local.process_key(), 1, 1, 16, ("127.0.0.1", 1, 2, 3))
    with pytest.raises(DescriptorError, match="malformed nixl descriptor"):
        await backend.read_into(bad, 0, memoryview(bytearray(4)))


# The agents live in child processes: a nixl wheel's bundled libibverbs can crash at interpreter
# exit when the system's rdma-core is loaded too, so each child reports and leaves by os._exit.
_OWNER = """
import json, os, sys
import numpy as np
from orchestr.fabric._buffers import _transport as _buffers
from orchestr.fabric._buffers._nixl import NixlBuffers

def say(obj):
    print("@@" + json.dumps(obj), flush=True)

t = NixlBuffers()
reason = t.probe()
if reason:
    say({"skip": reason})
    os._exit(0)
first = np.arange(1024, dtype=np.uint32)
a = _buffers.register_memory(memoryview(first).cast("B"), [t])
say(a.descriptor("nixl").to_wire())
sys.stdin.readline()
say({"head": first[:3].tolist()})
second = np.full(64, 5, dtype=np.uint8)
b = _buffers.register_memory(memoryview(second), [t])
_buffers.release(a, [t])
say(b.descriptor("nixl").to_wire())
sys.stdin.readline()
os._exit(0)
"""

_READER = """
import asyncio, json, os, sys
import numpy as np
from orchestr.errors import StaleDescriptorError
from orchestr.fabric._buffers._transport import Descriptor
from orchestr.fabric._buffers._nixl import NixlBuffers

def say(obj):
    print("@@" + json.dumps(obj), flush=True)

async def main():
    t = NixlBuffers()
    a = Descriptor.from_wire(json.loads(sys.stdin.readline()))
    dst = np.zeros(a.length // 4, np.uint32)
    await t.read_into(a, 0, memoryview(dst).cast("B"))
    part = np.zeros(2, np.uint32)
    await t.read_into(a, 8, memoryview(part).cast("B"))
    await t.write_from(a, 4, memoryview(np.array([77], np.uint32)).cast("B"))
    say({"full": dst.tolist() == list(range(1024)), "part": part.tolist()})
    b = Descriptor.from_wire(json.loads(sys.stdin.readline()))
    got = bytearray(64)
    await t.read_into(b, 0, memoryview(got))
    try:
        await t.read_into(a, 0, memoryview(bytearray(4)))
        stale = "read a released region"
    except StaleDescriptorError as exc:
        stale = str(exc)
    say({"second": list(got) == [5] * 64, "stale": stale})

asyncio.run(main())
os._exit(0)
"""


def _next(proc: subprocess.Popen[str]) -> Any:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("@@"):
            return json.loads(line[2:])
    raise AssertionError(f"the child exited ({proc.wait()}) before answering")


def _send(proc: subprocess.Popen[str], obj: Any) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(obj) + "\n")
    proc.stdin.flush()


def test_nixl_moves_bytes_between_two_processes() -> None:
    pytest.importorskip(
        "nixl",
        reason="nixl is not installed; the optional extra adds it: pip install 'orchestr[nixl]'",
    )
    owner, reader = (
        subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for code in (_OWNER, _READER)
    )
    try:
        first = _next(owner)
        if "skip" in first:
            pytest.skip(f"nixl is installed but not usable here: {first['skip']}")
        assert first[5][2].startswith("orchestr-")  # where: host, port, agent name, address
        _send(reader, first)
        assert _next(reader) == {"full": True, "part": [2, 3]}
        _send(owner, "go")
        assert _next(owner) == {"head": [0, 77, 2]}
        _send(reader, _next(owner))  # registered after the reader loaded the owner's metadata
        result = _next(reader)
        assert result["second"] is True
        assert "was released" in result["stale"]
        _send(owner, "done")
        assert owner.wait(timeout=30) == 0
        assert reader.wait(timeout=30) == 0
    finally:
        for proc in (owner, reader):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
