"""The paged engine's model step against ``transformers``: with the KV cache, prefix caching,
chunked prefill and preemption all on, every logit is within 1e-4 of the reference's and 64
greedy tokens are identical."""

from __future__ import annotations

import pathlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from orchestr.roles import models
from orchestr.roles.generator._blocks import BlockPool
from orchestr.roles.generator._paged import PagedKV, PagedRunner
from orchestr.roles.generator._scheduler import Scheduler, Seq

SHARED = "please answer the user: the first long token of the layer block cache "
TEXTS = [SHARED + "reverse 1 2", SHARED + "the model", "a", SHARED + "what is train and serve"]


@pytest.mark.parametrize(
    ("arch", "blocks", "budget"),
    [
        ("llama", 64, 16),  # chunked prefill, prefix hits
        ("qwen2", 40, 7),  # too few blocks for all four at once: preemption too
        ("qwen2_moe", 64, 16),  # routed experts and a shared expert
    ],
)
def test_greedy_decoding_over_the_paged_cache_matches_transformers(
    tmp_path: pathlib.Path, arch: str, blocks: int, budget: int
) -> None:
    folder = models.make_tiny(arch, tmp_path / arch)
    model, tok = models.load_model(folder), models.Tokenizer(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref.train(False)
    pool = BlockPool(blocks, 4)
    runner = PagedRunner(model, PagedKV(model, blocks, 4))
    sched = Scheduler(pool, max_batch=4, token_budget=budget, extra_keys=(arch, 0))
    seqs = [Seq(str(i), tok.encode(t, special=True), 64) for i, t in enumerate(TEXTS)]
    for seq in seqs:
        sched.add(seq)
    seen: dict[str, list[torch.Tensor]] = {s.id: [] for s in seqs}
    while sched.running or sched.waiting:
        step = sched.schedule()
        logits = runner.run(step)
        for sid, row in logits.items():
            seen[sid].append(row)
        sched.update(step, {sid: int(row.argmax()) for sid, row in logits.items()})
    assert sched.hits > 0 and pool.num_free == blocks
    if arch == "qwen2":
        assert sched.preemptions > 0
    with torch.no_grad():
        for seq in seqs:
            full = torch.tensor([seq.tokens])
            want = ref(input_ids=full).logits[0, len(seq.prompt) - 1 : -1]
            # one row per token it sampled (a preempted one's recompute samples only its next)
            assert len(seen[seq.id]) == len(seq.output)
            got = torch.stack(seen[seq.id])
            assert (got - want).abs().max().item() < 1e-4
            generated = ref.generate(
                torch.tensor([seq.prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False
            )
            assert seq.output == generated[0, len(seq.prompt) :].tolist()
