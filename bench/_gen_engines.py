"""One engine of ``bench/generation.py``, in a process of its own (so its peak memory is its
own): orchestr's paged engine, the recompute engine it replaces, or ``transformers``'
``generate()``; or the limit (the model's matrix multiplies alone).

    python bench/_gen_engines.py ENGINE CHECKPOINT SPEC_JSON

``SPEC_JSON`` holds the prompts (token ids, made by the driver so every engine gets the same)
and the lengths; see ``bench/generation.py``. Prints one JSON object, the last line of stdout.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
from _gen_measure import Generate, measure, peak_rss_mib

from orchestr.roles import PagedEngine, RecomputeEngine, Request, models


def orchestr_engine(folder: str, spec: dict[str, Any]) -> Generate:
    model = models.load_model(folder)
    tokens = spec["prefix"] + spec["suffix"] + spec["long_prompt"]
    engine = PagedEngine(
        model,
        num_blocks=(max(spec["batches"]) * (spec["prompt"] + spec["output"]) + 4 * tokens) // 16,
        block_size=16,
        max_batch=max(spec["batches"]),
        token_budget=spec["token_budget"],
    )
    return stepped(engine)


def recompute_engine(folder: str, spec: dict[str, Any]) -> Generate:
    model = models.load_model(folder)
    engine = RecomputeEngine(
        model, max_batch=max(spec["batches"]), pad_id=0, vocab_size=model.config.vocab_size
    )
    return stepped(engine)


def stepped(engine: RecomputeEngine | PagedEngine) -> Generate:
    """``generate`` over an orchestr engine: submit greedy requests that ignore the
    end-of-sequence token, step until all are done."""
    count = iter(range(1 << 30))

    def generate(prompts: list[list[int]], n: int) -> float:
        start = time.perf_counter()
        engine.submit(
            [Request(f"r{next(count)}", p, n, temperature=0.0, ignore_eos=True) for p in prompts]
        )
        while engine.has_work():
            engine.step()
        return time.perf_counter() - start

    return generate


def transformers_engine(folder: str, spec: dict[str, Any]) -> Generate:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train(False)

    def generate(prompts: list[list[int]], n: int) -> float:
        ids = torch.tensor(prompts)  # the prompts of one call have one length: no padding
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - start

    return generate


def limit(folder: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The model's own matrix multiplies at each workload's shapes, with nothing else: per
    decode step one ``[b, in] x [in, out]`` product per weight matrix (the LM head included),
    and for a 1024-token prefill the same with 1024 rows. Each shape is timed with the two
    kernels torch has for it on the CPU, ``F.linear`` and oneDNN's packed product (what the
    paged engine multiplies with), and the faster counts. The median of 20 timings."""
    model = models.load_model(folder)
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]

    def linear(x: torch.Tensor, i: int) -> None:
        torch.nn.functional.linear(x, weights[i])

    def onednn(x: torch.Tensor, i: int) -> None:
        torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], "")

    def step(rows: int, iters: int = 20) -> float:
        xs = [torch.randn(rows, w.shape[1]) for w in weights]
        best = float("inf")
        for kernel in (linear, onednn):
            times = []
            for _ in range(iters + 3):
                start = time.perf_counter()
                for i, x in enumerate(xs):
                    kernel(x, i)
                times.append(time.perf_counter() - start)
            best = min(best, sorted(times[3:])[iters // 2])
        return best

    out: dict[str, Any] = {f"decode_tokens_per_s_b{b}": b / step(b) for b in spec["batches"]}
    out["tpot_ms_b32"] = step(32) * 1e3
    out["ttft_ms_p1024"] = step(1024, 5) * 1e3
    out["prefix_ttft_speedup"] = None
    out["weights_mib"] = sum(w.numel() * w.element_size() for w in weights) / (1 << 20)
    return out


def main() -> None:
    engine, folder, spec_path = sys.argv[1:4]
    torch.set_num_threads(2)
    with open(spec_path) as f:
        spec = json.load(f)
    if engine == "limit":
        result = limit(folder, spec)
    else:
        make = {
            "orchestr": orchestr_engine,
            "recompute": recompute_engine,
            "transformers": transformers_engine,
        }[engine]
        output = spec["recompute_output"] if engine == "recompute" else spec["output"]
        result = measure(make(folder, spec), spec, output)
    result["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
