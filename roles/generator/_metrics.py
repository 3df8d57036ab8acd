"""A generator's engine metrics, exported through the head's ``GET /metrics``
(:mod:`orchestr.metrics`) under vLLM's names where the meaning is the same, so dashboards
made for vLLM read them: tagged ``model_name`` (the checkpoint or model factory) and
``engine`` (the actor, ``mesh[rank]``). Counters appear with ``_total`` appended, as
vLLM's do (``vllm:num_preemptions_total``).

========================================  =========  =================================================
name                                      kind       meaning
========================================  =========  =================================================
``vllm:num_requests_running``             gauge      requests in the running batch
``vllm:num_requests_waiting``             gauge      requests queued
``vllm:generation_tokens``                counter    tokens generated
``vllm:time_to_first_token_seconds``      histogram  submission to first token
``vllm:inter_token_latency_seconds``      histogram  between a request's tokens
``vllm:kv_cache_usage_perc``              gauge      the fraction of KV blocks in use (paged)
``vllm:prefix_cache_queries``             counter    prompt tokens looked up in the prefix cache
``vllm:prefix_cache_hits``                counter    of those, found there
``vllm:num_preemptions``                  counter    sequences preempted (recomputed later)
``orchestr:kv_transfers``                 counter    prefilled KV handed here and read
``orchestr:kv_transfer_bytes``            counter    the bytes of those reads
``orchestr:kv_transfer_seconds``          counter    seconds reading (or copying in place) them
``orchestr:kv_transfer_exposed_seconds``  counter    of those seconds, after the prefill had ended
``orchestr:kv_transfer_reads``            counter    one-sided reads (several a streamed one, staged)
``orchestr:kv_transfer_failures``         counter    reads failed or leases expired first
``orchestr:kv_handoff_leases``            counter    prompts prefilled here for another generator
``orchestr:kv_handoff_expired``           counter    of their leases, those no reader ended
========================================  =========  =================================================
"""

from __future__ import annotations

from collections.abc import Mapping

from orchestr import metrics

from ._core._contract import Engine

__all__ = ["EngineMetrics"]

#: Seconds; fine at the low end, where a CPU engine's token times are. (Both bucket lists are
#: tables of boundaries, kept in rows by ``fmt: skip`` rather than one number a line.)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
TAGS = ("model_name", "engine")
#: the paged engine's counters (``metrics()``), with their help texts
_COUNTERS = {
    "vllm:prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "vllm:prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "vllm:num_preemptions": "Sequences preempted, to be recomputed.",
    "orchestr:kv_transfers": "Requests whose prefilled KV was read from another generator.",
    "orchestr:kv_transfer_bytes": "Bytes of prefilled KV read from other generators.",
    "orchestr:kv_transfer_seconds": "Seconds spent reading prefilled KV (not ending leases).",
    "orchestr:kv_transfer_exposed_seconds": (
        "Of the seconds reading prefilled KV, those after its prefill had finished."
    ),
    "orchestr:kv_transfer_reads": "One-sided reads of prefilled KV (a streamed one makes several).",
    "orchestr:kv_transfer_failures": "Prefilled KV reads that failed or found the lease expired.",
    "orchestr:kv_handoff_leases": "Prompts prefilled here and held for another generator.",
    "orchestr:kv_handoff_expired": "Held prefills whose lease expired before a reader ended it.",
}


class EngineMetrics:
    """Publishes one engine's metrics; :meth:`publish` after each step (a few dict updates
    and one histogram bucket per token)."""

    def __init__(
        self,
        engine: Engine,
        *,
        model_name: str,
        engine_name: str,
        extra: tuple[Mapping[str, float], ...] = (),
    ) -> None:
        self.engine = engine
        self.extra = extra  # counters kept beside the engine, read at each publish
        self.tags = {"model_name": model_name, "engine": engine_name}
        self._running = metrics.Gauge(
            "vllm:num_requests_running", "Requests in the running batch.", TAGS
        )
        self._waiting = metrics.Gauge("vllm:num_requests_waiting", "Requests queued.", TAGS)
        self._tokens = metrics.Counter("vllm:generation_tokens", "Tokens generated.", TAGS)
        self._ttft = metrics.Histogram(
            "vllm:time_to_first_token_seconds",
            "Seconds from a request's submission to its first token.",
            TTFT_BUCKETS,
            TAGS,
        )
        self._itl = metrics.Histogram(
            "vllm:inter_token_latency_seconds",
            "Seconds between a request's successive tokens.",
            ITL_BUCKETS,
            TAGS,
        )
        self._usage = metrics.Gauge(
            "vllm:kv_cache_usage_perc", "The fraction of KV cache blocks in use (0 to 1).", TAGS
        )
        self._counters = {name: metrics.Counter(name, h, TAGS) for name, h in _COUNTERS.items()}
        self._seen = dict.fromkeys(_COUNTERS, 0.0)
        self.publish()

    def publish(self) -> None:
        """Bring the exported series up to the engine's state."""
        stats = self.engine.stats()
        self._running.set(stats.running, self.tags)
        self._waiting.set(stats.waiting, self.tags)
        ttft, itl = self.engine.take_latencies()
        self._tokens.inc(len(ttft) + len(itl), self.tags)  # one of the two per token
        for t in ttft:
            self._ttft.observe(t, self.tags)
        for t in itl:
            self._itl.observe(t, self.tags)
        now = self.engine.metrics()  # the recompute engine has none of these
        for counts in self.extra:
            now = {**now, **counts}
        if "vllm:kv_cache_usage_perc" in now:
            self._usage.set(now["vllm:kv_cache_usage_perc"], self.tags)
        for name in _COUNTERS:
            if name in now:
                self._counters[name].inc(now[name] - self._seen[name], self.tags)
                self._seen[name] = now[name]
