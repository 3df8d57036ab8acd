"""The paged engine's model step against ``transformers``: with the KV cache, prefix caching,
chunked prefill and preemption all on, every logit is within 1e-4 of the reference's and 64
greedy tokens are identical, whether decodes attend through orchestr's paged kernel or
torch's attention over the decode mirror."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from orchestr.roles import models
from orchestr.roles.generator._core._blocks import BlockPool
from orchestr.roles.generator._core._scheduler import Scheduler, Seq
from orchestr.roles.generator._runner._cache import KVCache
from orchestr.roles.generator._runner._mirror import DecodeMirror
from orchestr.roles.generator._runner._paged import AttentionMode, PagedRunner

SHARED = "please answer the user: the first long token of the layer block cache "
TEXTS = [SHARED + "reverse 1 2", SHARED + "the model", "a", SHARED + "what is train and serve"]


@dataclasses.dataclass
class Reference:
    """What ``transformers`` makes of an arch's tiny checkpoint: per text, its prompt, the
    prompt with its 64 greedy tokens, and the logits that predicted each of those tokens."""

    folder: pathlib.Path
    prompts: list[list[int]]
    tokens: list[list[int]]
    logits: list[torch.Tensor]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Reference]:
    """The reference of each arch, computed once for the module: the cases of an arch differ
    in the paged side only (blocks, budget, products, attention), never in the checkpoint or
    the prompts, so its greedy tokens and logits are the same for each of them."""
    made: dict[str, Reference] = {}

    def reference(arch: str) -> Reference:
        if arch not in made:
            folder = pathlib.Path(models.make_tiny(arch, tmp_path_factory.mktemp(arch) / arch))
            tok = models.Tokenizer(folder)
            ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            ref.train(False)
            prompts = [tok.encode(t, special=True) for t in TEXTS]
            tokens, logits = [], []
            with torch.no_grad():
                for prompt in prompts:
                    generated = ref.generate(
                        torch.tensor([prompt]),
                        max_new_tokens=64,
                        min_new_tokens=64,
                        do_sample=False,
                    )
                    tokens.append(generated[0].tolist())
                    logits.append(ref(input_ids=generated).logits[0, len(prompt) - 1 : -1])
            made[arch] = Reference(folder, prompts, tokens, logits)
        return made[arch]

    return reference


@pytest.mark.parametrize(
    ("arch", "blocks", "budget", "packed", "attention"),
    [
        # chunked prefill, prefix hits; packed products, the paged attention kernel
        ("llama", 64, 16, True, "kernel"),
        # four tokens a step among four sequences: one-token prompt chunks that do not sample
        # run beside the decodes, and steps where nothing samples (the last layer finishes
        # only the rows that sample)
        ("llama", 64, 4, True, "kernel"),
        # the modules' own products and torch's attention over the decode mirror (a GPU's path)
        ("llama", 64, 16, False, "torch"),
        # too few blocks for all four at once: preemption too, on both attentions
        ("qwen2", 40, 7, True, "kernel"),
        ("qwen2", 40, 7, True, "torch"),
        ("qwen2_moe", 64, 16, None, "auto"),  # routed experts and a shared expert
    ],
)
def test_greedy_decoding_over_the_paged_cache_matches_transformers(
    references: Callable[[str], Reference],
    arch: str,
    blocks: int,
    budget: int,
    packed: bool | None,
    attention: AttentionMode,
) -> None:
    ref = references(arch)
    model = models.load_model(ref.folder)
    pool = BlockPool(blocks, 4)
    runner = PagedRunner(model, KVCache(model, blocks, 4), packed=packed, attention=attention)
    assert runner.linears.packed is (packed is not False)  # this CPU packs
    assert (runner.ops is None) is (attention == "torch")  # and builds the kernel
    sched = Scheduler(pool, max_batch=4, token_budget=budget, extra_keys=(arch, 0))
    seqs = [Seq(str(i), list(prompt), 64) for i, prompt in enumerate(ref.prompts)]
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
    for i, seq in enumerate(seqs):
        # the reference's 64 greedy tokens, and so its logits are over the same sequence
        assert seq.tokens == ref.tokens[i]
        # one row per token it sampled (a preempted one's recompute samples only its next)
        assert len(seen[seq.id]) == len(seq.output)
        got = torch.stack(seen[seq.id])
        assert (got - ref.logits[i]).abs().max().item() < 1e-4


def test_the_decode_mirror_holds_what_the_pool_holds_whatever_joins_and_leaves() -> None:
    """Sequences join, decode, sit steps out, leave and come back recomputed, in random order;
    after every step each placed row equals its sequence's keys and values in the pool."""
    import random

    layers, heads, dim, size = 2, 2, 4, 4
    shape = (64, size, heads, dim)
    pool_k = [torch.zeros(shape) for _ in range(layers)]
    pool_v = [torch.zeros(shape) for _ in range(layers)]
    mirror = DecodeMirror(layers, heads, dim, torch.float32, torch.device("cpu"))
    rng = random.Random(0)
    free = list(range(64))
    seqs: list[Seq] = []

    def write(s: Seq, p: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        block, at = s.blocks[p // size], p % size
        pool_k[layer][block, at], pool_v[layer][block, at] = k, v

    def prefill(s: Seq, n: int) -> None:  # its first n tokens, into fresh blocks
        s.blocks = [free.pop() for _ in range(-(-(n + 12) // size))]
        s.num_computed = n
        for p in range(n):
            for layer in range(layers):
                write(s, p, layer, torch.randn(heads, dim), torch.randn(heads, dim))

    for step in range(120):
        if len(seqs) < 6 and rng.random() < 0.3:
            s = Seq(f"s{step}", [1] * 3, 12)
            prefill(s, rng.randrange(1, 8))
            seqs.append(s)
        if seqs and rng.random() < 0.1:  # one finishes: its blocks go back
            gone = seqs.pop(rng.randrange(len(seqs)))
            free.extend(gone.blocks)
        if seqs and rng.random() < 0.1:  # one is preempted and recomputed
            again = rng.choice(seqs)
            again.preemptions += 1
            free.extend(again.blocks)
            prefill(again, rng.randrange(1, 8))
        for full in [s for s in seqs if s.num_computed == len(s.blocks) * size]:
            seqs.remove(full)  # its blocks are full: it finished
            free.extend(full.blocks)
        decoding = [s for s in seqs if rng.random() < 0.85]  # the others sit this step out
        placed = mirror.place(decoding, pool_k, pool_v, size)
        assert sorted(map(id, placed)) == sorted(map(id, decoding))
        for layer in range(layers):
            k, v = torch.randn(len(placed), heads, dim), torch.randn(len(placed), heads, dim)
            mirror.append(layer, k, v)
            for i, s in enumerate(placed):
                write(s, s.num_computed, layer, k[i], v[i])
        longest = max((s.num_computed + 1 for s in placed), default=0)
        for layer in range(layers):
            kk, vv = mirror.view(layer, longest)
            for i, s in enumerate(placed):
                n = s.num_computed + 1
                slots = [s.blocks[p // size] * size + p % size for p in range(n)]
                want_k = pool_k[layer].view(-1, heads, dim)[slots].transpose(0, 1)
                want_v = pool_v[layer].view(-1, heads, dim)[slots].transpose(0, 1)
                assert torch.equal(kk[i, :, :n], want_k) and torch.equal(vv[i, :, :n], want_v)
        mirror.advance()
        for s in placed:
            s.num_computed += 1
    assert mirror.capacity[0] >= 6
