"""orchestr's kernels against torch. Decode attention against torch's attention over the same
keys and values gathered densely: grouped-query head layouts, head dims on the vectorised path
and off it, block sizes, ragged lengths; each sequence's output independent of the batch and
of the threads; bad tables and tensors refused with an error, never read past the pool. The
fused elementwise ops: rotary and the pool writes, SwiGLU's activation and the residual sum
give torch's bits; RMSNorm within float32 rounding."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from orchestr.roles import models
from orchestr.roles._common._hf._layers import Attention, RMSNorm, Rotary
from orchestr.roles.generator._runner._kernels import (
    DecodeAttention,
    Kernels,
    kernel_status,
    kernels,
)
from orchestr.roles.generator._runner._paged import PagedRunner


@pytest.fixture(scope="module")
def op() -> DecodeAttention:
    # the machines this runs on have a compiler: a kernel that fails to build is a failure,
    # not a quiet fall back to torch's attention
    assert kernel_status() is None
    ops = kernels()
    assert ops is not None
    return ops.decode_attention


def case(
    n: int, heads: int, kv_heads: int, dim: int, size: int, lengths: list[int], seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Queries, pools of keys and values with every sequence's blocks scattered at random,
    the tables (padded with -1 past what each sequence uses) and lengths."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n_ // size) for n_ in lengths)
    blocks = n * width + 3
    k = torch.randn(blocks, size, kv_heads, dim, generator=gen)
    v = torch.randn(blocks, size, kv_heads, dim, generator=gen)
    q = torch.randn(n, heads, dim, generator=gen)
    order = torch.randperm(blocks, generator=gen)
    tables = torch.full((n, width), -1, dtype=torch.int32)
    for i, length in enumerate(lengths):
        used = -(-length // size)
        tables[i, :used] = order[i * width : i * width + used].to(torch.int32)
    return q, k, v, tables, torch.tensor(lengths, dtype=torch.int64)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    out = []
    kv_heads, dim = k.shape[2:]
    for i, length in enumerate(lengths.tolist()):
        used = tables[i, : -(-length // k.shape[1])].long()
        kk = k[used].reshape(-1, kv_heads, dim)[:length].transpose(0, 1)[None]
        vv = v[used].reshape(-1, kv_heads, dim)[:length].transpose(0, 1)[None]
        qq = q[i][None, :, None]
        grouped = q.shape[1] != kv_heads
        out.append(F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=grouped)[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "size"),
    [
        (8, 4, 64, 16),  # the bench model's layout
        (4, 4, 128, 16),  # no grouping, the other vectorised head dim
        (8, 1, 64, 4),  # one kv head for all (multi-query)
        (6, 2, 48, 5),  # groups of 3; a head dim off the vectorised path; odd blocks
        (2, 2, 32, 16),  # the RL example's model (head dim 32, unrolled)
    ],
)
def test_the_kernel_equals_torch_attention_over_the_gathered_blocks(
    op: DecodeAttention, heads: int, kv_heads: int, dim: int, size: int
) -> None:
    lengths = [1, size, size + 1, 3 * size - 1, 97, 300]
    q, k, v, tables, lens = case(len(lengths), heads, kv_heads, dim, size, lengths)
    got = op(q, k, v, tables, lens, dim**-0.5)
    want = reference(q, k, v, tables, lens)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-5


def test_a_sequence_gets_the_same_bits_alone_in_any_batch_and_on_any_threads(
    op: DecodeAttention,
) -> None:
    lengths = [40, 7, 130, 64, 1, 33]
    q, k, v, tables, lens = case(len(lengths), 8, 4, 64, 16, lengths, seed=1)
    together = op(q, k, v, tables, lens, 0.125)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            # one sequence alone: fewer sequences than threads split its heads over tasks
            for i in range(len(lengths)):
                alone = op(q[i : i + 1], k, v, tables[i : i + 1], lens[i : i + 1], 0.125)
                assert torch.equal(alone[0], together[i]), (count, i)
            assert torch.equal(op(q, k, v, tables, lens, 0.125), together)
    finally:
        torch.set_num_threads(threads)


def test_bad_tables_and_tensors_are_refused_before_anything_is_read(
    op: DecodeAttention,
) -> None:
    q, k, v, tables, lens = case(2, 8, 4, 64, 16, [20, 40])
    bad_block = tables.clone()
    bad_block[1, 2] = k.shape[0]  # one past the pool
    with pytest.raises(RuntimeError, match="names block"):
        op(q, k, v, bad_block, lens, 0.125)
    bad_block[1, 2] = -1
    with pytest.raises(RuntimeError, match="names block"):
        op(q, k, v, bad_block, lens, 0.125)
    with pytest.raises(RuntimeError, match="has length"):
        op(q, k, v, tables, torch.tensor([20, 16 * tables.shape[1] + 1]), 0.125)
    with pytest.raises(RuntimeError, match="has length"):
        op(q, k, v, tables, torch.tensor([0, 40]), 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        op(q.double(), k, v, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="int32"):
        op(q, k, v, tables.long(), lens, 0.125)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="evenly"):
        op(torch.randn(2, 6, 64), k, v, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match="sequences"):
        op(q, k, v, tables[:1], lens, 0.125)
    with pytest.raises(RuntimeError, match="shape"):
        op(q, k, v[:, :8].contiguous(), tables, lens, 0.125)


def test_turned_off_the_engine_attends_with_torch_and_says_why(tmp_path: pathlib.Path) -> None:
    code = (
        "from orchestr.roles import models\n"
        "from orchestr.roles.generator._runner._kernels import kernel_status\n"
        "from orchestr.roles.generator._runner._cache import KVCache\n"
        "from orchestr.roles.generator._runner._paged import PagedRunner\n"
        "import sys\n"
        "model = models.load_model(models.make_tiny('llama', sys.argv[1]))\n"
        "runner = PagedRunner(model, KVCache(model, 8, 4))\n"
        "print(kernel_status(), runner.ops)\n"
        "try:\n"
        "    PagedRunner(model, KVCache(model, 8, 4), attention='kernel')\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    env = dict(os.environ, ORCHESTR_KERNELS="0")
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "llama")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "ORCHESTR_KERNELS=0 None"
    assert "cannot run here: it is not built" in lines[1]


def test_attention_must_be_a_known_choice() -> None:
    with pytest.raises(ValueError, match="'auto', 'kernel' or 'torch'"):
        PagedRunner(None, None, attention="fast")


@pytest.fixture(scope="module")
def ops() -> Kernels:
    built = kernels()
    assert built is not None
    return built


def test_rotary_and_the_pool_writes_give_torchs_bits(ops: Kernels, tmp_path: pathlib.Path) -> None:
    folder = models.make_tiny("qwen2", tmp_path / "q", layers=1, hidden=96, heads=6, kv_heads=2)
    cfg = models.read_config(folder)
    attn, rotary = Attention(cfg), Rotary(cfg)
    heads, kv_heads, dim = 6, 2, cfg.head_dim
    gen = torch.Generator().manual_seed(3)
    t = 11
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=gen)
    positions = torch.tensor([0, 1, 2, 15, 16, 17, 200, 3, 4, 5, 511])
    slots = torch.randperm(8 * 4, generator=gen)[:t]
    k_pool, v_pool = torch.zeros(8, 4, kv_heads, dim), torch.zeros(8, 4, kv_heads, dim)
    # the torch path: rotations of these positions, then project's rotation
    cos, sin = rotary(positions[None])
    q_want, k_want, v_want = attn.project(qkv[None], cos, sin, qkv[None])
    table = rotary(torch.arange(512)[None])
    half = dim // 2
    cos_t, sin_t = table[0][0, :, :half].contiguous(), table[1][0, :, :half].contiguous()
    rows = qkv.clone()
    ops.rope_and_cache(rows, positions, cos_t, sin_t, k_pool, v_pool, slots, heads)
    q_got = rows[:, : heads * dim].view(t, heads, dim).transpose(0, 1)
    assert torch.equal(q_got, q_want[0])
    flat_k, flat_v = k_pool.view(-1, kv_heads, dim), v_pool.view(-1, kv_heads, dim)
    assert torch.equal(flat_k[slots].transpose(0, 1), k_want[0])
    assert torch.equal(flat_v[slots].transpose(0, 1), v_want[0])
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()
    # refused before anything is written
    for bad_slots, bad_pos, match in [
        (torch.tensor([32] + [0] * (t - 1)), positions, "outside the pool"),
        (slots, torch.tensor([512] + [0] * (t - 1)), "past the 512 rotations"),
        (slots[:3], positions, "int64"),
    ]:
        before = k_pool.clone()
        with pytest.raises(RuntimeError, match=match):
            ops.rope_and_cache(qkv.clone(), bad_pos, cos_t, sin_t, k_pool, v_pool, bad_slots, heads)
        assert torch.equal(k_pool, before)
    with pytest.raises(RuntimeError, match="qkv must be"):
        ops.rope_and_cache(qkv.clone(), positions, cos_t, sin_t, k_pool, v_pool, slots, heads + 1)


def test_swiglu_activation_and_residual_norm_against_torch(ops: Kernels) -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(37, 2 * 100, generator=gen)  # a width off the vector size: the tail too
    gate, up = x.chunk(2, -1)
    assert torch.equal(ops.silu_and_mul(x), F.silu(gate) * up)
    with pytest.raises(RuntimeError, match="even"):
        ops.silu_and_mul(torch.randn(3, 5))
    norm = RMSNorm(200, 1e-6)
    norm.weight.data = torch.randn(200, generator=gen)
    hidden, delta = torch.randn(1, 37, 200, generator=gen), torch.randn(1, 37, 200, generator=gen)
    summed = hidden + delta
    got = ops.add_rms_norm(hidden, delta, norm.weight.data, 1e-6)
    assert torch.equal(hidden, summed)  # the residual sum, in place
    with torch.no_grad():
        want = norm(summed)
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()
    alone = ops.add_rms_norm(summed.clone(), None, norm.weight.data, 1e-6)
    assert torch.equal(alone, got)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.add_rms_norm(hidden, delta, torch.ones(10), 1e-6)
    with pytest.raises(RuntimeError, match="is not hidden's"):
        ops.add_rms_norm(hidden, delta[:, :3], norm.weight.data, 1e-6)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "size"),
    [(8, 4, 64, 16), (4, 4, 128, 16), (8, 1, 64, 4), (6, 2, 48, 5), (2, 2, 32, 16)],
)
def test_prefill_chunks_attend_causally_as_torch_does(
    ops: Kernels, heads: int, kv_heads: int, dim: int, size: int
) -> None:
    gen = torch.Generator().manual_seed(5)
    for start, n in [(0, 1), (0, 37), (0, 130), (19, 1), (50, 30), (200, 75)]:
        total = start + n
        used = -(-total // size)
        k = torch.randn(used + 4, size, kv_heads, dim, generator=gen)
        v = torch.randn(used + 4, size, kv_heads, dim, generator=gen)
        table = torch.randperm(used + 4, generator=gen)[:used].to(torch.int32)
        # queries as the runner passes them: rows of a fused q/k/v product
        rows = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen)
        q = rows[:, : heads * dim].view(n, heads, dim)
        got = ops.prefill_attention(q, k, v, table, start, dim**-0.5)
        kk = k[table.long()].reshape(-1, kv_heads, dim)[:total].transpose(0, 1)[None]
        vv = v[table.long()].reshape(-1, kv_heads, dim)[:total].transpose(0, 1)[None]
        sees = torch.arange(total)[None, :] <= torch.arange(start, total)[:, None]
        want = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kk, vv, attn_mask=sees, enable_gqa=heads != kv_heads
        )[0].transpose(0, 1)
        assert (got - want).abs().max().item() < 1e-5, (start, n)
        # a position's result is the same bits whether its chunk is split or not, on any
        # number of threads
        if n > 1:
            cut = n // 2
            first = ops.prefill_attention(q[:cut], k, v, table, start, dim**-0.5)
            threads = torch.get_num_threads()
            try:
                torch.set_num_threads(1)
                second = ops.prefill_attention(q[cut:], k, v, table, start + cut, dim**-0.5)
            finally:
                torch.set_num_threads(threads)
            assert torch.equal(torch.cat([first, second]), got)


def test_prefill_refuses_tables_that_do_not_reach(ops: Kernels) -> None:
    k = v = torch.zeros(4, 16, 2, 64)
    q = torch.randn(20, 4, 64)
    with pytest.raises(RuntimeError, match="its table holds 32"):
        ops.prefill_attention(q, k, v, torch.tensor([0, 1], dtype=torch.int32), 20, 0.125)
    with pytest.raises(RuntimeError, match="names block 4"):
        ops.prefill_attention(q, k, v, torch.tensor([0, 4], dtype=torch.int32), 0, 0.125)
    with pytest.raises(RuntimeError, match="from position -1"):
        ops.prefill_attention(q, k, v, torch.tensor([0, 1, 2], dtype=torch.int32), -1, 0.125)
    with pytest.raises(RuntimeError, match="int32"):
        ops.prefill_attention(q, k, v, torch.tensor([0, 1]), 0, 0.125)
