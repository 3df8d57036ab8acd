"""Tensor-parallel generators: each rank's share of a checkpoint is the slices Megatron's cut
gives it, and a model split over two processes computes what the whole one does (every logit
within 1e-4, the same greedy tokens) for llama, qwen2 and qwen2_moe with prefix caching,
chunked prefill and preemption on. A trainer's weights sync slice by slice to the same digest
as a whole generator's. Blocks move between pools of different degrees (handoffs, a shared
KV store) in the whole model's layout. The ranks leave with their leader however it ends, a
lost rank fails the step instead of hanging it, and no other user can reach the group's
store."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import orchestr as oc
from orchestr.roles import Generator, KVNamespace, KVOptions, KVStore, kv_block_bytes, models
from orchestr.roles._common._backend import choose_backend
from orchestr.roles._common._hf._config import read_config
from orchestr.roles._common._hf._tp import TPShard, check_tp, load_shard
from orchestr.roles.generator._core._types import Completion, Request
from orchestr.roles.generator._engines._build import build_engine
from orchestr.roles.generator._engines._paged import PagedEngine
from tests.roles.generator.test_kv_offload import _keys, _metrics
from tests.roles.weight_actors import CheckpointTrainer

PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    made: dict[str, str] = {}

    def checkpoint(arch: str, kv_heads: int = 2) -> str:
        key = f"{arch}-kv{kv_heads}"
        if key not in made:
            # an odd vocabulary (cut unevenly) and two key/value heads for four query heads
            made[key] = models.make_tiny(
                arch, tmp_path_factory.mktemp(key) / arch, vocab=301, heads=4, kv_heads=kv_heads
            )
        return made[key]

    return checkpoint


def _engine(folder: str, tp: int, **kv: object) -> PagedEngine:
    options = KVOptions(**{"num_blocks": 64, "block_size": 4, "token_budget": 8, **kv})
    _, engine = build_engine(
        choose_backend("cpu"), "", 0, 8, engine="paged", checkpoint=folder, kv=options,
        vllm=None, model_kwargs=None, version=0, eos_id=None, pad_id=None, max_seq_len=None,
        vocab_size=None, tp=tp,
    )  # fmt: skip
    assert isinstance(engine, PagedEngine)
    return engine


def _serve(engine: PagedEngine) -> tuple[list[dict[str, torch.Tensor]], dict[str, list[int]]]:
    """Every step's logits and every request's tokens: three prompts sharing a prefix, then
    one more that finds it cached."""
    logits: list[dict[str, torch.Tensor]] = []
    run = engine._runner.run

    def recorded(step):  # type: ignore[no-untyped-def]
        out = run(step)
        logits.append({k: v.clone() for k, v in out.items()})
        return out

    engine._runner.run = recorded  # type: ignore[method-assign]
    done: list[Completion] = []
    engine.submit(
        [Request(id=f"r{i}", prompt=PROMPT[: 12 + 9 * i], max_new_tokens=12) for i in range(3)]
    )
    while engine.has_work():
        done += engine.step()
    engine.submit([Request(id="again", prompt=PROMPT, max_new_tokens=6)])
    while engine.has_work():
        done += engine.step()
    return logits, {c.id: list(c.tokens) for c in done}


@pytest.mark.parametrize(
    ("arch", "kv_heads", "kv"),
    [
        ("llama", 2, {}),
        ("qwen2", 2, {"attention": "torch"}),  # torch's attention over the decode mirror
        ("qwen2_moe", 2, {}),
        ("llama", 2, {"num_blocks": 14, "attention": "torch"}),  # preemption too
        ("qwen2", 1, {}),  # one key/value head for two ranks: each holds it whole
    ],
)
def test_a_split_model_computes_what_the_whole_one_does(
    checkpoints: Callable[..., str], arch: str, kv_heads: int, kv: dict[str, object]
) -> None:
    folder = checkpoints(arch, kv_heads)
    shares = [TPShard(read_config(folder), 2, r).kv_heads for r in range(2)]
    assert [(s.start, s.stop) for s in shares] == (
        [(0, 1), (0, 1)] if kv_heads == 1 else [(0, 1), (1, 2)]
    )
    whole = _engine(folder, 1, **kv)
    want_logits, want_tokens = _serve(whole)
    split = _engine(folder, 2, **kv)
    try:
        got_logits, got_tokens = _serve(split)
        metrics = split.metrics()
    finally:
        split.close()
    assert got_tokens == want_tokens
    assert len(got_logits) == len(want_logits)
    for got, want in zip(got_logits, want_logits, strict=True):
        assert got.keys() == want.keys()
        for k in got:
            assert got[k].shape == want[k].shape == (301,)
            torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=0)
    assert metrics["vllm:prefix_cache_hits"] > 0  # the last prompt's prefix was cached
    if kv.get("num_blocks") == 14:
        assert metrics["vllm:num_preemptions"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2_moe"])
@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_reads_its_slices_of_the_checkpoint(
    checkpoints: Callable[[str], str], arch: str, tp: int
) -> None:
    folder = checkpoints(arch)
    whole = models.load_model(folder).state_dict()
    cfg = read_config(folder)
    rows = 0
    for rank in range(tp):
        share = load_shard(folder, tp, rank)
        shard = TPShard(cfg, tp, rank)
        attn = share.model.layers[0].self_attn
        assert isinstance(attn, models.Attention)
        assert attn.heads == 4 // tp and attn.kv_heads == max(1, 2 // tp)
        for name, tensor in share.state_dict().items():
            cut = shard.cut(name)
            assert torch.equal(tensor, whole[name] if cut is None else whole[name][cut]), name
        rows += share.lm_head.weight.shape[0]
    assert rows == 301  # the vocabulary, cut unevenly, is all there once
    if tp == 4:  # two key/value heads over four ranks: ranks 0, 1 share head 0; 2, 3 head 1
        assert [TPShard(cfg, 4, r).kv_heads.start for r in range(4)] == [0, 0, 1, 1]


def test_a_model_the_ranks_cannot_cut_is_refused(checkpoints: Callable[[str], str]) -> None:
    cfg = read_config(checkpoints("llama"))  # 4 heads, 2 key/value heads
    with pytest.raises(oc.ConfigError, match="must divide the 4 attention heads"):
        check_tp(cfg, 3)
    for bad in (0, True, 1.5):
        with pytest.raises(oc.ConfigError, match="tp is a whole number"):
            check_tp(cfg, bad)
    with pytest.raises(oc.ConfigError, match="must divide the 4 attention heads"):
        _engine(checkpoints("llama"), 3)
    with pytest.raises(oc.ConfigError, match="splits a checkpoint on the paged engine"):
        build_engine(
            choose_backend("cpu"), "orchestr.roles:TinyLM", 0, 8, engine=None, checkpoint=None,
            kv=None, vllm=None, model_kwargs=None, version=0, eos_id=None, pad_id=None,
            max_seq_len=None, vocab_size=None, tp=2,
        )  # fmt: skip


def test_a_lost_rank_fails_the_step_and_close_stops_the_rest(
    checkpoints: Callable[[str], str],
) -> None:
    engine = _engine(checkpoints("llama"), 2)
    ranks = engine._ranks
    assert ranks is not None
    try:
        engine._ranks._procs[0].kill()  # type: ignore[union-attr]
        engine._ranks._procs[0].wait()  # type: ignore[union-attr]
        engine.submit([Request(id="a", prompt=PROMPT[:10], max_new_tokens=4)])
        with pytest.raises(RuntimeError):  # the step fails (a hang would never return)
            while engine.has_work():
                engine.step()
    finally:
        engine.close()
    assert not os.path.exists(ranks.folder)


LEADER = textwrap.dedent(
    """
    import sys, time
    from orchestr.roles import KVOptions
    from orchestr.roles._common._backend import choose_backend
    from orchestr.roles.generator._engines._build import build_engine
    _, engine = build_engine(
        choose_backend("cpu"), "", 0, 8, engine="paged", checkpoint=sys.argv[1],
        kv=KVOptions(num_blocks=16), vllm=None, model_kwargs=None, version=0, eos_id=None,
        pad_id=None, max_seq_len=None, vocab_size=None, tp=2,
    )
    print(engine._ranks._procs[0].pid, engine._ranks.folder, flush=True)
    time.sleep(600)
    """
)


def test_the_ranks_leave_when_their_leader_is_killed(checkpoints: Callable[[str], str]) -> None:
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER, checkpoints("llama")], stdout=subprocess.PIPE, text=True
    )
    assert leader.stdout is not None
    pid_text, folder = leader.stdout.readline().split()
    pid = int(pid_text)
    try:
        assert os.stat(folder).st_mode & 0o077 == 0  # the store's folder: this user's only
        store = os.path.join(folder, "store")
        # another user cannot open the store the ranks meet at (nor list or enter the folder)
        attack = subprocess.run(
            ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable,
             "-c", f"open({store!r}, 'r+b')"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert attack.returncode != 0 and "PermissionError" in attack.stderr, attack.stderr
        os.kill(pid, 0)  # the rank is there
        leader.send_signal(signal.SIGKILL)
        leader.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.1)
        assert not _alive(pid)
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait()
        leader.stdout.close()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, waiting for init to reap it, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_load_shard_holds_a_share_of_the_weights(checkpoints: Callable[[str], str]) -> None:
    folder = checkpoints("qwen2_moe")
    whole = sum(t.numel() for t in models.load_model(folder).state_dict().values())
    share = load_shard(folder, 2, 1)
    held = sum(t.numel() for t in share.state_dict().values())
    assert held < 0.6 * whole  # only norms, routers and gates are whole on every rank
    assert pathlib.Path(folder, "model.safetensors").exists()


async def test_a_split_generator_syncs_a_trainers_weights_slice_by_slice(
    ctx: oc.JobContext, checkpoints: Callable[[str], str]
) -> None:
    """A tp=2 generator beside a whole one: the same tokens before and after both sync a
    trainer's step, the same digest (the split one's put together from its ranks), and a
    corrupted sync refused with nothing changed; expert hosts refuse it."""
    folder = checkpoints("qwen2")  # tied embeddings: the head is the embedding's slice
    kv = {"num_blocks": 64, "block_size": 4}
    trainer, split, whole = await asyncio.gather(
        ctx.spawn(CheckpointTrainer, folder, name="trainer"),
        ctx.spawn(Generator, name="split", checkpoint=folder, tp=2, kv=kv, supervise="handle"),
        ctx.spawn(Generator, name="whole", checkpoint=folder, torch_threads=1, kv=kv),
    )
    requests = [Request(f"r{i}", PROMPT[: 10 + i], 8, temperature=0.0) for i in range(3)]

    async def tokens(gen: oc.Mesh) -> list[list[int]]:
        return [list(c.tokens) for c in await gen.generate.call_one(requests)]

    before = await tokens(whole)
    assert await tokens(split) == before
    start = await trainer.digest.call_one()
    assert (await split.digest.call_one())["digest"] == start
    ref = await trainer.step.call_one(1)
    for gen in (split, whole):
        synced = await gen.sync_weights.call_one(ref)
        assert synced["loaded"] and synced["version"] == 1
    trained = await trainer.digest.call_one()
    assert trained != start
    assert (await split.digest.call_one())["digest"] == trained
    assert (await whole.digest.call_one())["digest"] == trained
    after = await tokens(whole)
    assert await tokens(split) == after != before
    # a sync whose bytes were changed after publishing is refused and changes nothing
    bad = await trainer.step.call_one(2)
    await trainer.corrupt.call_one(bad, 0, 5)
    with pytest.raises(oc.ActorError, match="ChecksumMismatchError"):
        await split.sync_weights.call_one(bad)
    kept = await split.digest.call_one()
    assert (kept["digest"], kept["version"]) == (trained, 1)
    # whole tensors through load_weights: the trainer's, as version 3
    state = await trainer.tensors.call_one()  # tied tensors once: name the head too
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    await split.load_weights.call_one(state, 3)
    assert (await split.digest.call_one())["digest"] == await trainer.digest.call_one()
    with pytest.raises(oc.ConfigError, match="experts cannot be used with tp=2 yet"):
        Generator(checkpoint=folder, tp=2, experts={"hosts": whole})
    await trainer.close.call_one()


def test_a_split_pool_gives_and_takes_whole_blocks(checkpoints: Callable[[str], str]) -> None:
    """Blocks exported from a tp=2 pool are the whole pool's (every rank's heads in their
    places), and whole blocks written into it come back out as they went in."""
    folder = checkpoints("qwen2_moe")
    whole, split = _engine(folder, 1), _engine(folder, 2)
    try:
        prompt = PROMPT[:21]  # five full blocks of four
        for engine in (whole, split):
            engine.submit([Request(id="p", prompt=prompt, max_new_tokens=1)])
            while engine.has_work():
                engine.step()
        keys, blocks = whole.hold_prefix(prompt)
        split_keys, split_blocks = split.hold_prefix(prompt)
        assert keys == split_keys and len(blocks) == 5
        assert split.block_nbytes == whole.block_nbytes and split.kv_layout == whole.kv_layout
        kv = split._split
        assert kv is not None
        want, got = whole._kv.export(blocks), kv.export(split_blocks)
        for a, b in zip(want, got, strict=True):
            torch.testing.assert_close(
                b.view(torch.float32), a.view(torch.float32), atol=1e-5, rtol=0
            )
        # the whole pool's blocks written into free blocks of the split one read back whole
        free = [b for b in range(64) if b not in split_blocks][:5]
        kv.write(free, kv.planes_of(want))
        for a, b in zip(want, kv.export(free), strict=True):
            assert torch.equal(a, b)
        memory, ids, layout = split.lend(split_blocks)
        assert ids == [0, 1, 2, 3, 4] and layout == (whole.kv_layout[0], 5 * layout[2], layout[2])
        lent = memory.view(layout[0], 5, layout[2])
        assert torch.equal(lent[:, 2], got[2].view(layout[0], layout[2]))
        assert split.kv_memory.numel() * 2 == whole.kv_memory.numel()  # its heads only
    finally:
        split.close()


async def test_handoffs_between_pools_of_different_degrees(
    ctx: oc.JobContext, checkpoints: Callable[[str], str]
) -> None:
    """A tp=2 prefill generator hands to a tp=1 decode one and the reverse (each decode
    rank taking the heads it holds), read in place or staged, and the decode side continues
    exactly as one generator alone would."""
    folder = checkpoints("llama")
    kv = {"num_blocks": 64, "block_size": 4}

    def spawn(name: str, tp: int, **kw: object) -> Any:
        threads = {} if tp > 1 else {"torch_threads": 1}
        return ctx.spawn(Generator, name=name, checkpoint=folder, tp=tp, kv=kv, **threads, **kw)

    pre2, dec1, pre1, dec2, staged2, alone = await asyncio.gather(
        spawn("pre2", 2), spawn("dec1", 1), spawn("pre1", 1), spawn("dec2", 2),
        spawn("staged2", 2, handoff={"read": "staged", "on_failure": "fail"}), spawn("alone", 1),
    )  # fmt: skip
    pairs = [(pre2, dec1), (pre1, dec2), (pre2, staged2), (pre1, staged2)]
    for i, (pre, dec) in enumerate(pairs):
        r = Request(f"h{i}", [(5 * i + j) % 250 + 3 for j in range(30)], 8, temperature=0.0)
        h = (await pre.prefill.call_one(r)).sent_from(pre)
        assert h.tokens == 28 and h.lease > 0
        before = (await dec.stats.call_one())["orchestr:kv_transfers"]
        (got,) = await dec.generate.call_one([r], kv_from={r.id: h})
        (want,) = await alone.generate.call_one([r])
        assert got.tokens == want.tokens, (i, got.tokens, want.tokens)
        torch.testing.assert_close(
            torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0
        )
        stats = await dec.stats.call_one()
        assert stats["orchestr:kv_transfers"] == before + 1, i  # read, not computed again
        assert stats["orchestr:kv_transfer_failures"] == 0
        assert (await pre.stats.call_one())["held"] == 0  # the lease ended
    with pytest.raises(oc.ActorError, match="a streamed handoff"):
        await pre2.prefill.call_one(Request("s", PROMPT[:12], 4), stream=True)


async def test_split_and_whole_generators_share_a_kv_store(
    ctx: oc.JobContext, checkpoints: Callable[[str], str]
) -> None:
    """Blocks a tp=2 generator offloads are onboarded by a tp=1 one and the reverse: the
    store holds whole blocks, whoever computed them."""
    folder = checkpoints("llama")
    store = await ctx.spawn(KVStore, kv_block_bytes(folder, 4), 64)
    kv = {"num_blocks": 64, "block_size": 4}
    split, whole = await asyncio.gather(
        ctx.spawn(Generator, name="split", checkpoint=folder, tp=2, kv=kv, kv_store=store),
        ctx.spawn(Generator, name="whole", checkpoint=folder, torch_threads=1, kv=kv,
                  kv_store=store),
    )  # fmt: skip
    for i, (first, second) in enumerate(((split, whole), (whole, split))):
        p = [(11 * i + j) % 250 + 3 for j in range(33)]  # 8 full blocks before the last token
        ask = {"prompt": p, "max_new_tokens": 6, "temperature": 0.0}
        (a,) = await first.generate.call_one([{"id": f"a{i}", **ask}])
        model_id, keys = await _keys(first, p)
        ns = KVNamespace(model_id, 4, 0)
        for _ in range(1200):  # the offload runs after the step, on its own
            if (await store.match.call_one(ns, keys))["tokens"] == 32:
                break
            await asyncio.sleep(0.05)
        assert (await store.match.call_one(ns, keys))["tokens"] == 32
        before = (await _metrics(second))["orchestr:kv_store_onboarded_tokens"]
        (b,) = await second.generate.call_one([{"id": f"b{i}", **ask}])
        assert b.tokens == a.tokens
        after = (await _metrics(second))["orchestr:kv_store_onboarded_tokens"]
        assert after - before == 32, i
