"""The paged runner's packed products: they equal the modules' own, follow every way weights
change (in place, re-pointed, a new version), refuse where they cannot run; and the process
keeps freed memory for the next tensor."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from typing import cast

import pytest
import torch

from orchestr.roles import PagedEngine, Request, models
from orchestr.roles._common import _alloc
from orchestr.roles._common._hf._layers import DecoderLayer
from orchestr.roles.generator._runner._linears import Linears, can_pack


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> models.CausalLM:
    # q/k/v biases: the fused product carries them
    return models.load_model(models.make_tiny("qwen2", tmp_path_factory.mktemp("m") / "q"))


def test_packed_products_equal_the_modules_and_follow_weight_changes(
    qwen2: models.CausalLM,
) -> None:
    lin = Linears(qwen2, packed=True)  # every product, small ones too
    assert lin.packed
    layer = cast(DecoderLayer, qwen2.model.layers[0])
    attn, mlp = layer.self_attn, layer.mlp
    x = torch.randn(1, 5, qwen2.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want_qkv = torch.cat((attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)), -1)
        got = lin.qkv(attn, x)
        assert got is not None
        torch.testing.assert_close(got, want_qkv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lin.mlp(mlp, x), mlp(x), rtol=1e-5, atol=1e-5)
        packs = lin.packs
        lin.qkv(attn, x)
        assert lin.packs == packs  # unchanged weights: the packed copy is reused
        # written in place: the version counter moved
        attn.q_proj.weight.mul_(2)
        moved = lin.qkv(attn, x)
        assert moved is not None and lin.packs == packs + 1
        q = attn.q_proj.out_features
        torch.testing.assert_close(moved[..., :q], attn.q_proj(x), rtol=1e-5, atol=1e-5)
        # re-pointed at other memory (a double-buffered load): the storage moved
        attn.q_proj.weight.data = attn.q_proj.weight.detach().clone() / 2
        torch.testing.assert_close(lin.qkv(attn, x), want_qkv, rtol=1e-5, atol=1e-5)
        assert lin.packs == packs + 2
        lin.invalidate()
        lin.qkv(attn, x)
        assert lin.packs == packs + 3


def test_unpacked_products_are_the_modules_and_packing_refuses_where_it_cannot_run(
    qwen2: models.CausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    lin = Linears(qwen2, packed=False)
    attn = cast(DecoderLayer, qwen2.model.layers[0]).self_attn
    x = torch.randn(1, 3, qwen2.config.hidden_size)
    assert lin.qkv(attn, x) is None  # project() makes its own
    with torch.no_grad():
        assert torch.equal(
            lin.linear(attn.o_proj, torch.ones(1, 1, attn.o_proj.in_features)),
            attn.o_proj(torch.ones(1, 1, attn.o_proj.in_features)),
        )
    assert "bfloat16" in (can_pack(torch.zeros(2, 2, dtype=torch.bfloat16)) or "")
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    with pytest.raises(ValueError, match="cannot run here: .*oneDNN"):
        Linears(qwen2, packed=True)
    assert not Linears(qwen2).packed
    monkeypatch.undo()
    # on: only products big enough to gain are packed
    auto = Linears(qwen2)
    assert auto.packed and auto.qkv(attn, x) is None and auto.packs == 0


def test_an_engine_reads_weights_written_in_place_after_a_new_version(
    qwen2: models.CausalLM,
) -> None:
    # the reference loop's way: the optimiser writes the weights in place, then set_version
    engine = PagedEngine(qwen2, num_blocks=64, block_size=4, token_budget=64, packed=True)

    def greedy(rid: str) -> list[float]:
        engine.submit([Request(rid, [3, 4, 5, 6, 7], 6, temperature=0.0)])
        done = []
        while engine.has_work():
            done += engine.step()
        return done[0].logprobs

    before = greedy("a")
    saved = {k: v.clone() for k, v in qwen2.state_dict().items()}
    try:
        with torch.no_grad():
            for p in qwen2.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
        engine.set_version(1)
        after = greedy("b")
        assert after != before
        unpacked = PagedEngine(qwen2, num_blocks=64, block_size=4, token_budget=64, packed=False)
        unpacked.submit([Request("c", [3, 4, 5, 6, 7], 6, temperature=0.0)])
        done = []
        while unpacked.has_work():
            done += unpacked.step()
        assert done[0].logprobs == pytest.approx(after, abs=1e-5)
    finally:
        qwen2.load_state_dict(saved)


# the module alone, by its path: importing orchestr.roles would import torch (seconds)
KEEP = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("alloc", sys.argv[1])
alloc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(alloc)
keep_freed_memory = alloc.keep_freed_memory

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

kept = keep_freed_memory()
block = bytearray(64 << 20)  # written: resident
before = rss_kib()
del block
print(kept, before - rss_kib())
"""


@pytest.mark.parametrize("setting", ["1", "0"])
def test_freed_memory_stays_in_the_process_unless_turned_off(
    tmp_path: pathlib.Path, setting: str
) -> None:
    env = dict(os.environ, ORCHESTR_KEEP_FREED_MEMORY=setting)
    out = subprocess.run(
        [sys.executable, "-c", KEEP, _alloc.__file__],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    kept, returned_kib = out[0] == "True", int(out[1])
    assert kept is (setting == "1")
    if kept:
        assert returned_kib < 8 << 10  # the 64 MiB block stayed for the next allocation
    else:
        assert returned_kib > 48 << 10  # glibc's default: unmapped on free


RETURN = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("alloc", sys.argv[1])
alloc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(alloc)

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

done = alloc.return_freed_memory() if sys.argv[2] == "return" else False
first = bytearray(8 << 20)
del first  # glibc's threshold rises past 8 MiB: blocks this size now come from the heap
blocks = [bytearray(8 << 20) for _ in range(6)]
pin = bytearray(1 << 16)  # after them on the heap: its top is not free
before = rss_kib()
del blocks
print(done, before - rss_kib())
"""


@pytest.mark.parametrize("mode", ["return", "default"])
def test_a_sharded_trainers_freed_buffers_go_back_to_the_kernel(mode: str) -> None:
    """``return_freed_memory`` (a sharded trainer's): 48 MiB of freed 8 MiB buffers leave
    the process, where glibc's rising threshold would keep them."""
    out = subprocess.run(
        [sys.executable, "-c", RETURN, _alloc.__file__, mode],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    done, returned_kib = out[0] == "True", int(out[1])
    assert done is (mode == "return")
    if done:
        assert returned_kib > 40 << 10
    else:
        assert returned_kib < 8 << 10


PEAK = """
import importlib.util, resource, sys
spec = importlib.util.spec_from_file_location("alloc", sys.argv[1])
alloc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(alloc)
print(alloc.peak_resident_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""

# a large process (a controller holding a model) starts a small worker
PARENT = """
import subprocess, sys
held = bytearray(512 << 20)  # written: resident
print(subprocess.run([sys.executable, "-c", sys.argv[1], sys.argv[2]], capture_output=True,
                     text=True, check=True).stdout)
"""


def test_a_workers_peak_is_its_own_not_its_starters() -> None:
    """``peak_resident_bytes`` is the program's own since its ``exec``; ``ru_maxrss`` (the
    control) carries the 512 MiB process that started it."""
    out = subprocess.run(
        [sys.executable, "-c", PARENT, PEAK, _alloc.__file__],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    peak, maxrss = int(out[0]), int(out[1])
    assert maxrss > 512 << 20
    assert 0 < peak < 128 << 20
