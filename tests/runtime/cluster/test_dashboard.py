"""The head's dashboard: what its pages show (percentiles from buckets, rates over a window,
a job's event log read as it grows, the timeline's layout), and its HTTP side against a real
head: the login, the token never given back, the live stream, the assets served locally.
A browser drives it in ``test_dashboard_browser.py``; another user attacks it in
``tests/security/test_dashboard_access.py``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import http.client
import json
import queue
import re
import threading
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import orchestr as oc
from orchestr._cluster._dashboard._tail import MAX_STEPS, EventTail
from orchestr._cluster._dashboard._view import (
    Scrape,
    curve,
    histogram_quantile,
    serving_view,
    timeline,
)
from orchestr._cluster._exposition import Family
from tests.cluster import open_cluster
from tests.runtime.actors import Counter

TOKEN = "dashboard-test-token-0123456789"
DASHBOARD = Path(__file__).resolve().parents[3] / "runtime" / "_cluster" / "_dashboard"
DECISION = Path(__file__).resolve().parents[3] / "docs" / "decisions" / "0020-dashboard.md"


# -- what the pages show ---------------------------------------------------------------------
def test_quantiles_interpolate_inside_their_bucket() -> None:
    bounds = (0.1, 0.2, 0.4)
    assert histogram_quantile(bounds, [0, 0, 0, 0], 0.5) is None
    # 10 in (0, 0.1], 10 in (0.1, 0.2]: the median is the first bucket's top
    assert histogram_quantile(bounds, [10, 10, 0, 0], 0.5) == pytest.approx(0.1)
    assert histogram_quantile(bounds, [10, 10, 0, 0], 0.75) == pytest.approx(0.15)
    assert histogram_quantile(bounds, [0, 0, 4, 0], 0.25) == pytest.approx(0.25)
    # above every boundary: the highest one, as Prometheus answers
    assert histogram_quantile(bounds, [0, 0, 0, 3], 0.5) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(bounds, [1, 0, 0, 0], 1.5)


def _scrape(at: float, ttft: list[int], tokens: float, usage: float) -> Scrape:
    hist = Family("vllm:time_to_first_token_seconds", "histogram", "", (0.01, 0.1))
    hist.add_histogram(ttft, 0.0, engine="gen[0]", model_name="m")
    itl = Family("vllm:inter_token_latency_seconds", "histogram", "", (0.005, 0.05))
    itl.add_histogram([int(tokens), 0, 0], 0.0, engine="gen[0]", model_name="m")
    toks = Family("vllm:generation_tokens_total", "counter", "")
    toks.add(tokens, engine="gen[0]", model_name="m")
    kv = Family("vllm:kv_cache_usage_perc", "gauge", "")
    kv.add(usage, engine="gen[0]", model_name="m")
    hits = Family("vllm:prefix_cache_hits_total", "counter", "")
    hits.add(30, engine="gen[0]", model_name="m")
    queries = Family("vllm:prefix_cache_queries_total", "counter", "")
    queries.add(120, engine="gen[0]", model_name="m")
    return Scrape.of(at, [hist, itl, toks, kv, hits, queries])


def test_serving_rates_and_percentiles_are_over_the_window() -> None:
    before = _scrape(100.0, [50, 0, 0], 1000, 0.1)  # 50 fast requests long ago
    now = _scrape(110.0, [50, 0, 20], 1500, 0.25)  # then 20 slow ones
    (row,) = serving_view(now, before)
    assert row["engine"] == "gen[0]"
    assert row["rps"] == pytest.approx(2.0) and row["tokens_s"] == pytest.approx(50.0)
    assert row["ttft_p50"] == pytest.approx(0.1)  # only the window's (slow) requests
    assert row["kv_usage"] == 0.25 and row["prefix_hit"] == pytest.approx(0.25)
    (first,) = serving_view(before, None)  # one scrape: everything so far, no rate
    assert first["rps"] is None and first["ttft_p50"] == pytest.approx(0.005)
    # a restarted generator's counts went down: the window is its counts since the restart
    (after_restart,) = serving_view(_scrape(120.0, [3, 0, 0], 10, 0.0), now)
    assert after_restart["ttft_p50"] == pytest.approx(0.005)


def test_the_event_log_is_read_as_it_grows(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    tail = EventTail(path)
    assert not tail.poll()  # no file yet
    with path.open("w") as f:
        f.write(
            json.dumps(
                {"ts": 10.0, "kind": "phase", "name": "generation", "track": "phases", "dur": 2.0}
            )
            + "\n"
        )
        f.write("not json\n[1, 2]\n")
        f.write(json.dumps({"ts": 12.5, "kind": "actor_died", "actor": "gen[0]"}) + "\n")
        f.write('{"ts": 13.0, "kind": "rl_st')  # being written
        f.flush()
        assert tail.poll()
        assert [s.name for s in tail.spans] == ["generation"] and tail.marks[0].kind == "actor_died"
        assert not tail.steps
        f.write('ep", "step": 0, "reward": 0.5, "mean_length": 7}\n')
        for step, reward in ((1, 0.6), (2, 0.7), (1, 0.65)):  # step 1 rolled back, redone
            f.write(
                json.dumps(
                    {
                        "ts": 14.0,
                        "kind": "rl_step",
                        "step": step,
                        "reward": reward,
                        "mean_length": 8,
                    }
                )
                + "\n"
            )
    assert tail.poll()
    assert [(s.step, s.reward) for s in tail.steps] == [(0, 0.5), (1, 0.65)]
    assert (tail.first, tail.last) == (10.0, 14.0)
    path.write_text("")  # replaced: read again from the start
    assert not tail.poll() and tail.offset == 0


def test_a_long_runs_curve_is_thinned_not_cut(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    rows = (
        json.dumps({"ts": 1.0, "kind": "rl_step", "step": i, "reward": i, "mean_length": 1})
        for i in range(3 * MAX_STEPS)
    )
    path.write_text("\n".join(rows) + "\n")
    tail = EventTail(path)
    while tail.poll():
        pass
    assert len(tail.steps) <= MAX_STEPS
    assert tail.steps[0].step == 0 and tail.steps[-1].step >= 3 * MAX_STEPS - 4


def test_the_timeline_lays_spans_and_marks_on_one_axis() -> None:
    from orchestr._cluster._dashboard._tail import Mark, Span

    spans = [Span("generation", "phases", 0.0, 5.0), Span("train", "trainer", 5.0, 5.0, "boom")]
    laid = timeline(spans, [Mark("restart", 7.5, "gen[0]")], 0.0, 10.0)
    assert laid["tracks"] == ["phases", "trainer"]
    assert [(b["track"], b["x"], b["width"]) for b in laid["bars"]] == [(0, 0, 500), (1, 500, 500)]
    assert laid["bars"][1]["error"] == "boom" and laid["marks"][0]["x"] == 750
    line = curve([1.0, None, 3.0])
    assert line["points"] == "0.0,100.0 1000.0,0.0" and line["last"] == 3.0
    assert curve([])["points"] == ""


def test_the_vendored_assets_are_the_recorded_ones() -> None:
    """htmx and its SSE extension are the releases the decision record names, byte for byte."""
    record = DECISION.read_text()
    for name in ("htmx.min.js", "sse.min.js"):
        digest = hashlib.sha256((DASHBOARD / "static" / name).read_bytes()).hexdigest()
        assert f"`{name}`" in record and digest in record, name


# -- the HTTP side ---------------------------------------------------------------------------
@dataclasses.dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: str


def _call(
    address: str,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
) -> Answer:
    conn = http.client.HTTPConnection(address, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return Answer(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode())
    finally:
        conn.close()


async def call(
    address: str,
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
) -> Answer:
    return await asyncio.to_thread(_call, address, method, path, headers, body)


def _form(**fields: str) -> tuple[dict[str, str], bytes]:
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    return headers, urllib.parse.urlencode(fields).encode()


@pytest.fixture
async def dashboard() -> AsyncIterator[tuple[oc.JobContext, str]]:
    config = dataclasses.replace(oc.load_config(), dashboard_port=0, metrics_token=TOKEN)
    async with open_cluster(config) as ctx:
        assert ctx.dashboard_address is not None
        yield ctx, ctx.dashboard_address


async def test_pages_need_the_token_and_the_cookie_is_not_it(
    dashboard: tuple[oc.JobContext, str],
) -> None:
    ctx, address = dashboard
    await ctx.spawn(Counter, n=1, name="counted")
    r = await call(address, "GET", "/actors")
    assert r.status == 303 and r.headers["location"] == "/login?next=/actors"
    assert (await call(address, "GET", "/stream/actors")).status == 401
    assert (await call(address, "GET", "/healthz")).body == "ok\n"
    login = await call(address, "GET", "/login")
    assert login.status == 200 and TOKEN not in login.body
    r = await call(address, "POST", "/login?next=/actors", *_form(token="wrong"))
    assert r.status == 401 and "not this head's token" in r.body and "wrong" not in r.body
    assert "set-cookie" not in r.headers
    # a login leads only to this server's own pages
    r = await call(address, "POST", "/login?next=//elsewhere.example/x", *_form(token=TOKEN))
    assert r.status == 303 and r.headers["location"] == "/"
    cookie = r.headers["set-cookie"]
    assert TOKEN not in cookie
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
    session = {"Cookie": cookie.split(";")[0]}
    page = await call(address, "GET", "/actors", session)
    assert page.status == 200 and 'data-actor="counted[0]"' in page.body
    assert TOKEN not in page.body
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe" not in csp
    # every script and stylesheet the page names is served here
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', page.body)
    assert len(assets) == 3
    for asset in assets:
        assert (await call(address, "GET", asset)).status == 200, asset
    headers, _ = _form()
    r = await call(address, "POST", "/login", headers, b"token=" + b"x" * 5000)
    assert r.status == 413
    out = await call(address, "POST", "/logout", session)
    assert out.status == 303 and 'orchestr_dashboard=""' in out.headers["set-cookie"]
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert (await call(address, "GET", "/", bearer)).status == 200
    assert (await call(address, "GET", "/jobs/no-such-job", bearer)).status == 404
    assert (await call(address, "GET", "/stream/nowhere", bearer)).status == 404


def _page_events(address: str, path: str, out: queue.Queue[str], stop: threading.Event) -> None:
    """Put the data of each ``page`` event of a server-sent event stream on ``out``."""
    conn = http.client.HTTPConnection(address, timeout=30)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {TOKEN}"})
        r = conn.getresponse()
        assert r.getheader("content-type", "").startswith("text/event-stream")
        kind, data = "", []
        while not stop.is_set():
            line = r.readline().decode().rstrip("\n")
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
            elif not line and data:
                if kind == "page":
                    out.put("\n".join(data))
                kind, data = "", []
    finally:
        conn.close()


@contextlib.contextmanager
def _stream(address: str, path: str) -> Iterator[queue.Queue[str]]:
    out: queue.Queue[str] = queue.Queue()
    stop = threading.Event()
    reader = threading.Thread(target=_page_events, args=(address, path, out, stop), daemon=True)
    reader.start()
    try:
        yield out
    finally:
        stop.set()


async def test_the_stream_sends_a_page_again_when_it_changed(
    dashboard: tuple[oc.JobContext, str],
) -> None:
    ctx, address = dashboard
    with _stream(address, "/stream/actors") as events:
        first = await asyncio.to_thread(events.get, timeout=20)
        assert "No actor yet" in first
        await ctx.spawn(Counter, n=2, name="streamed")
        second = await asyncio.to_thread(events.get, timeout=20)
        assert 'data-actor="streamed[1]"' in second


async def test_a_head_with_the_dashboard_off_serves_none() -> None:
    async with open_cluster() as ctx:
        assert ctx.dashboard_address is None


async def test_a_taken_port_is_refused_saying_which(
    dashboard: tuple[oc.JobContext, str],
) -> None:
    _, address = dashboard
    port = int(address.rpartition(":")[2])
    config = dataclasses.replace(oc.load_config(), dashboard_port=port)
    with pytest.raises(oc.ConfigError, match=f"cannot serve the dashboard on 127.0.0.1:{port}"):
        async with oc.open_local_cluster(config):
            pass
