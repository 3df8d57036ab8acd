"""The soak's load (``bench/soak.py``): closed-loop clients drawing requests from a seeded
mix, and a :class:`Tally` of what they saw. Every request is bounded (at most 64 tokens, an
answer within :data:`ANSWER_S`); a bad body must be refused with 400 or 413."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import random
import statistics
import time
from typing import Any

import httpx2

#: The mix: each kind's weight.
MIX = {
    "completion": 16,
    "stream": 14,
    "chat": 12,
    "chat_stream": 8,
    "n": 8,
    "stop": 8,
    "stream_cancel": 8,
    "hangup": 6,
    "bad": 20,
}
WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls count stars and "
         "rivers carry old songs to the sea").split()  # fmt: skip
ANSWER_S = 120.0  # a request with no answer by then is a hang


class Tally:
    """What the clients saw: outcomes by kind, latencies by time, failures with causes."""

    def __init__(self, t0: float, window_s: float, grace_s: float) -> None:
        self.t0, self.window_s, self.grace_s = t0, window_s, grace_s
        self.served: collections.Counter[str] = collections.Counter()
        self.refused: collections.Counter[str] = collections.Counter()
        self.cancelled: collections.Counter[str] = collections.Counter()
        self.failed: collections.Counter[str] = collections.Counter()
        self.failed_near_kill: collections.Counter[str] = collections.Counter()
        self.latency: list[tuple[float, str, float]] = []
        #: When each failure was first seen (seconds into the run).
        self.first: dict[str, float] = {}
        self.kills: list[dict[str, Any]] = []

    def near_kill(self, t: float) -> bool:
        return any(0 <= t - k["t"] <= self.grace_s for k in self.kills)

    def record(self, kind: str, started: float, outcome: str, cause: str | None) -> None:
        """One request's ``outcome``: served (its latency kept), refused (a bad body, as it
        should be), cancelled (closed by the client, as meant) or failed (with its cause)."""
        now = time.monotonic()
        if outcome == "served":
            self.served[kind] += 1
            self.latency.append((started - self.t0, kind, now - started))
        elif outcome == "refused":
            self.refused[f"{kind} {cause}"] += 1
        elif outcome == "cancelled":
            self.cancelled[kind] += 1
        else:  # near a kill by when it ended: a request in flight at the kill counts
            key, near = f"{kind}: {cause}", self.near_kill(now - self.t0)
            (self.failed_near_kill if near else self.failed)[key] += 1
            self.first.setdefault(("near a kill: " if near else "") + key, now - self.t0)

    def windows(self) -> list[dict[str, Any]]:
        by: dict[int, list[float]] = collections.defaultdict(list)
        for t, _, seconds in self.latency:
            by[int(t // self.window_s)].append(seconds * 1000)
        return [
            {"window": i, "from_s": i * self.window_s, "served": len(ms), **percentiles(ms)}
            for i, ms in sorted(by.items())
        ]

    def kinds(self) -> dict[str, dict[str, float]]:
        by: dict[str, list[float]] = collections.defaultdict(list)
        for _, kind, seconds in self.latency:
            by[kind].append(seconds * 1000)
        return {k: percentiles(v) for k, v in sorted(by.items())}


def percentiles(ms: list[float]) -> dict[str, float]:
    if not ms:
        return {}
    cuts = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else ms * 99
    return {"p50_ms": round(cuts[49], 1), "p99_ms": round(cuts[98], 1)}


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


#: Bodies the server must refuse: each one's name, route and how to make it.
DEPTH = 100_000
BAD: list[tuple[str, str, Any]] = [
    ("invalid_json", "/v1/completions", lambda rng: b'{"model": "tiny", "prompt": "hi", '),
    ("not_utf8", "/v1/chat/completions", lambda rng: b'{"messages": "\xff\xfe"}'),
    ("prompt_int", "/v1/completions", lambda rng: {"prompt": 5, "max_tokens": 4}),
    ("max_tokens_str", "/v1/completions", lambda rng: {"prompt": "hi", "max_tokens": "8"}),
    ("messages_str", "/v1/chat/completions", lambda rng: {"messages": "hi", "max_tokens": 4}),
    ("top_k_2**63", "/v1/completions", lambda rng: {"prompt": "hi", "max_tokens": 4, "top_k": 2**63}),
    ("seed_2**64", "/v1/completions", lambda rng: {"prompt": "hi", "max_tokens": 4, "seed": 2**64}),
    ("temperature_1e999", "/v1/completions", lambda rng: b'{"prompt": "hi", "temperature": 1e999}'),
    ("top_p_nan", "/v1/completions", lambda rng: b'{"prompt": "hi", "top_p": NaN}'),
    ("n_10**6", "/v1/completions", lambda rng: {"prompt": "hi", "max_tokens": 4, "n": 10**6}),
    ("logprobs_1000", "/v1/completions", lambda rng: {"prompt": "hi", "logprobs": 1000}),
    ("token_10**12", "/v1/completions", lambda rng: {"prompt": [10**12], "max_tokens": 4}),
    ("max_tokens_2**63", "/v1/chat/completions",
     lambda rng: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2**63}),
    ("nested_list", "/v1/completions", lambda rng: b"[" * DEPTH + b"]" * DEPTH),
    ("nested_prompt", "/v1/completions",
     lambda rng: b'{"prompt": ' + b"[" * DEPTH + b"]" * DEPTH + b"}"),
    ("long_prompt", "/v1/completions",
     lambda rng: {"prompt": prompt(rng, 100_000), "max_tokens": 4}),
    ("long_chat", "/v1/chat/completions",
     lambda rng: {"messages": [{"role": "user", "content": "x" * 300_000}] * 4}),
    ("many_stops", "/v1/completions", lambda rng: {"prompt": "hi", "stop": ["a"] * 10_000}),
    ("long_stop", "/v1/completions", lambda rng: {"prompt": "hi", "stop": "s" * 100_000}),
    ("prompt_lone_surrogate", "/v1/completions", lambda rng: b'{"prompt": "\\ud800"}'),
    ("stop_lone_surrogate", "/v1/completions",
     lambda rng: b'{"prompt": "hi", "max_tokens": 4, "stop": "\\udfff"}'),
    ("salt_lone_surrogate", "/v1/completions",
     lambda rng: b'{"prompt": "hi", "max_tokens": 4, "cache_salt": "\\ud800"}'),
    ("chat_lone_surrogate", "/v1/chat/completions",
     lambda rng: b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 4}'),
    ("detokenize_huge_id", "/detokenize", lambda rng: {"tokens": [2**63]}),
    ("tokenize_mixed_list", "/tokenize", lambda rng: {"prompt": ["a", 1]}),
]  # fmt: skip
#: A body over the server's 16 MiB is sent in 1 of this many bad bodies.
HUGE_ONE_IN = 40


@functools.cache
def huge() -> bytes:
    """A body over the server's 16 MiB (made once)."""
    return json.dumps({"prompt": "x" * (17 << 20)}).encode()


def bad_body(rng: random.Random) -> tuple[str, str, bytes]:
    """A body the server must refuse: its name, its route and its bytes."""
    if rng.randrange(HUGE_ONE_IN) == 0:
        return "body_over_16MiB", "/v1/completions", huge()
    name, path, make = rng.choice(BAD)
    body = make(rng)
    return name, path, body if isinstance(body, bytes) else json.dumps(body).encode()


async def one(
    kind: str, h: httpx2.AsyncClient, rng: random.Random, port: int
) -> tuple[str, str | None]:
    """Send one request of ``kind``: its outcome (see :meth:`Tally.record`) and, when it
    failed, the cause."""
    if kind == "bad":
        name, path, content = bad_body(rng)
        r = await h.post(path, content=content, headers={"content-type": "application/json"})
        if r.status_code not in (400, 413):
            return "failed", f"{name} answered {r.status_code} {error_type(r)}"
        return "refused", f"{name} {r.status_code}"
    if kind == "hangup":
        await hang_up(rng, port)
        return "cancelled", None
    chat = kind.startswith("chat")
    body: dict[str, Any] = {
        "model": "tiny",
        "max_tokens": rng.randint(4, 24),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "seed": rng.randrange(1 << 20),
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt(rng, rng.randint(2, 40))}]
    else:
        body["prompt"] = prompt(rng, rng.randint(2, 200))
    if kind == "n":
        body["n"] = rng.randint(2, 4)
    if kind == "stop":
        body["stop"] = [rng.choice(WORDS), " the"]
    stream = kind in ("stream", "chat_stream", "stream_cancel")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not stream:
        r = await h.post(path, json=body)
        if r.status_code != 200:
            return "failed", f"{r.status_code} {error_type(r)}"
        return ("served", None) if r.json().get("choices") else ("failed", "200 without choices")
    body.update(stream=True, stream_options={"include_usage": True})
    if kind == "stream_cancel":
        body.update(max_tokens=64, ignore_eos=True)
    stop_after = rng.randint(1, 4) if kind == "stream_cancel" else None
    events = 0
    async with h.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return "failed", f"{r.status_code} {error_type(r)}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "served", None
            event = json.loads(line[6:])
            if "error" in event:
                return "failed", f"error event {event['error'].get('type')}"
            events += 1
            if stop_after is not None and events >= stop_after:
                return "cancelled", None  # leaving the block closes the stream midway
    return "failed", "stream ended without [DONE]"


def error_type(r: httpx2.Response) -> str:
    try:
        return str(r.json()["error"]["type"])
    except (ValueError, KeyError, TypeError):
        return "(no error body)"


async def hang_up(rng: random.Random, port: int) -> None:
    """A whole completion asked for on a raw connection, closed before its answer."""
    body = json.dumps({"prompt": prompt(rng, 20), "max_tokens": 64, "ignore_eos": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        await asyncio.sleep(rng.uniform(0.01, 0.3))
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def client(
    index: int, url: str, port: int, seed: int, tally: Tally, until: float, stop: asyncio.Event
) -> None:
    rng = random.Random(f"{seed}-{index}")
    kinds, weights = list(MIX), list(MIX.values())
    timeout = httpx2.Timeout(ANSWER_S, connect=10.0)
    async with httpx2.AsyncClient(base_url=url, timeout=timeout) as h:
        while time.monotonic() < until and not stop.is_set():
            kind = rng.choices(kinds, weights)[0]
            started = time.monotonic()
            try:
                outcome, cause = await one(kind, h, rng, port)
            except httpx2.TimeoutException:
                outcome, cause = "failed", f"no answer in {ANSWER_S:.0f} s (hang)"
            except Exception as exc:  # the client's side of a failure, named
                outcome, cause = "failed", f"client {type(exc).__name__}"
            tally.record(kind, started, outcome, cause)
