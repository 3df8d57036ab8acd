"""How ``bench/generation.py`` measures an engine, shared by orchestr's side
(``bench/_gen_engines.py``) and vLLM's (``bench/peers/vllm_generate.py``, another venv): only
the standard library here.

``generate(prompts, n)`` runs the prompts (token ids) together to ``n`` greedy tokens each and
returns the wall seconds. For batch ``b``: ``T1`` = one token for ``b`` fresh prompts, ``T`` =
``output`` tokens for ``b`` other fresh prompts (so no prefix cache helps either);
``decode_tokens_per_s_bB`` = ``b * (output - 1) / (T - T1)`` and ``tpot_ms_b32`` =
``(T - T1) / (output - 1)`` at b = 32. ``ttft_ms_p1024``: one token for one fresh 1024-token
prompt. ``prefix_ttft_speedup``: one token for a prompt of a 1024-token prefix and its own
suffix, then for another prompt of that prefix and another suffix: the first's time over the
second's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Generate = Callable[[list[list[int]], int], float]


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(generate: Generate, spec: dict[str, Any], output: int) -> dict[str, Any]:
    """Every workload on one engine (see ``bench/generation.py`` for what each figure is)."""
    out: dict[str, Any] = {}
    p = spec["prompts"]
    generate(p["warmup"], 2)
    for b in spec["batches"]:
        first = generate(p[f"first_b{b}"], 1)
        whole = generate(p[f"decode_b{b}"], output)
        decode = max(whole - first, 1e-9)
        out[f"decode_tokens_per_s_b{b}"] = b * (output - 1) / decode
        if b == 32:
            out["tpot_ms_b32"] = decode / (output - 1) * 1e3
    out["ttft_ms_p1024"] = generate([p["long"]], 1) * 1e3
    out["p1024_o64_s"] = generate([p["long_again"]], spec["long_output"])
    cold = generate([p["prefix"][0]], 1)
    warm = generate([p["prefix"][1]], 1)
    out["prefix_ttft_speedup"] = cold / warm
    out["prefix_ttft_ms"] = [cold * 1e3, warm * 1e3]
    out["output_tokens"] = output
    return out
