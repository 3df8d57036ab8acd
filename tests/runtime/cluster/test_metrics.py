"""The head's Prometheus endpoint: the text format, the aggregation, and scrapes of a real
cluster over loopback (calls, errors, bytes, bad clients, a worker that does not answer)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import signal
import urllib.request
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest

import orchestr as oc
from orchestr import metrics
from orchestr._cluster import _metrics
from orchestr._cluster._exposition import (
    Family,
    ScrapeReport,
    actor_families,
    cluster_families,
    format_value,
    render,
    workers_to_scrape,
)
from orchestr._cluster._headstate import HeadState
from orchestr._cluster._metrics import route
from orchestr._control._convert_stats import worker_stats_from_pb, worker_stats_to_pb
from orchestr._stats import (
    ActorStats,
    EndpointStats,
    TransportStats,
    WorkerStats,
)
from orchestr.config import load_config
from orchestr.errors import ConfigError
from tests.cluster import open_cluster
from tests.runtime.actors import Counter, ExitsAtOnce, Metered

# -- a small parser for the text exposition format ---------------------------------------------

_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m[1], m[1]), value)


def parse(text: str) -> tuple[Samples, dict[str, str]]:
    """Samples by (name, labels) and the type of each family; checks that every family has
    one HELP and one TYPE line, before its samples, and that no series repeats."""
    assert text.endswith("\n")
    samples: Samples = {}
    types: dict[str, str] = {}
    helps: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ")[2]
            assert name not in helps, f"two HELP lines for {name}"
            helps.add(name)
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name not in types, f"two TYPE lines for {name}"
            types[name] = kind
            continue
        m = _SAMPLE.fullmatch(line)
        assert m, f"not a sample line: {line!r}"
        name, inner, value = m.groups()
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        if name not in types and types.get(family) == "histogram":
            name_of_family = family
        else:
            name_of_family = name
        assert name_of_family in types and name_of_family in helps, (
            f"{name} has a sample before its HELP/TYPE"
        )
        labels: list[tuple[str, str]] = []
        pos = 0
        while inner and pos < len(inner):
            lm = _LABEL.match(inner, pos)
            assert lm, f"bad labels in {line!r}"
            labels.append((lm[1], _unescape(lm[2])))
            pos = lm.end()
        key = (name, frozenset(labels))
        assert key not in samples, f"series repeated: {line!r}"
        samples[key] = float(value)
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def matching(samples: Samples, name: str, **labels: str) -> list[float]:
    want = set(labels.items())
    return [v for (n, ls), v in samples.items() if n == name and want <= ls]


# -- the text format ----------------------------------------------------------------------------


def test_label_values_and_help_are_escaped() -> None:
    family = Family("orchestr_x_total", "counter", 'back\\slash and\nnewline "quoted"')
    family.add(3, mesh='a"b', actor="c\\d", endpoint="e\nf")
    text = render([family])
    assert text == (
        '# HELP orchestr_x_total back\\\\slash and\\nnewline "quoted"\n'
        "# TYPE orchestr_x_total counter\n"
        'orchestr_x_total{mesh="a\\"b",actor="c\\\\d",endpoint="e\\nf"} 3\n'
    )
    samples, types = parse(text)
    assert value(samples, "orchestr_x_total", mesh='a"b', actor="c\\d", endpoint="e\nf") == 3
    assert types == {"orchestr_x_total": "counter"}


def test_help_and_type_once_per_family_and_samples_sum() -> None:
    calls = Family("orchestr_calls_total", "counter", "calls")
    calls.add(1, actor="a")
    calls.add(2, actor="b")
    calls.add(4, actor="a")
    nodes = Family("orchestr_nodes", "gauge", "nodes")
    nodes.add(1)
    empty = Family("orchestr_empty", "gauge", "no samples yet")
    text = render([calls, nodes, empty])
    assert text.count("# HELP orchestr_calls_total ") == 1
    assert text.count("# TYPE orchestr_calls_total counter") == 1
    samples, types = parse(text)
    assert value(samples, "orchestr_calls_total", actor="a") == 5
    assert value(samples, "orchestr_nodes") == 1
    assert types["orchestr_empty"] == "gauge"
    with pytest.raises(ValueError, match="appears twice"):
        render([calls, calls])


@pytest.mark.parametrize("name", ["1abc", "a-b", "", "a b"])
def test_bad_metric_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="metric name"):
        Family(name, "gauge", "x")


@pytest.mark.parametrize("label", ["__reserved", "a-b", "1x"])
def test_bad_label_names_are_refused(label: str) -> None:
    with pytest.raises(ValueError, match="label name"):
        Family("ok", "gauge", "x").add(1, **{label: "v"})


@pytest.mark.parametrize(
    ("number", "text"),
    [(3, "3"), (2.5, "2.5"), (float("inf"), "+Inf"), (float("-inf"), "-Inf"), (0.0, "0.0")],
)
def test_values(number: float, text: str) -> None:
    assert format_value(number) == text
    assert format_value(float("nan")) == "NaN"


# -- aggregation (sans-IO) ---------------------------------------------------------------------


def _state() -> HeadState:
    state = HeadState()
    state.register_node("n1", "h:1", {"cpu": 4.0}, {}, 0.0)
    state.register_node("n2", "h:2", {"cpu": 2.0}, {}, 0.0)
    state.nodes["n2"].alive = False
    ids = {0: "a-0", 1: "a-1"}
    records = state.place("m-1", "gen", "x:Y", 2, {"cpu": 1.0}, {}, ids)
    for r in records:
        state.actor_started(r.actor_id, f"w-{r.rank}", "tcp://h:9", 1, ["go"])
        r.control_address = "h:7000" if r.rank == 0 else "h:7001"
    records[1].restarts = 2
    state.place("m-2", "old", "x:Y", 1, {}, {}, {0: "a-2"})
    state.actor_ended("a-2", stopped=False)
    return state


def test_workers_to_scrape_are_those_with_a_live_actor_each_once() -> None:
    state = _state()
    state.actors["a-1"].control_address = "h:7000"  # two actors in one worker
    assert workers_to_scrape(state) == ["h:7000"]
    state.nodes["n1"].alive = False  # missed its heartbeats
    assert workers_to_scrape(state) == []
    state.nodes["n1"].alive = True
    state.actors["a-0"].state = "dead"
    state.actors["a-1"].state = "restarting"
    assert workers_to_scrape(state) == []


def test_cluster_families_join_the_workers_with_the_heads_state() -> None:
    state = _state()
    w0 = WorkerStats(
        "w-0",
        [ActorStats("a-0", "gen[0]", 3, 1, [EndpointStats("go", 10, 2)])],
        [
            TransportStats("stream", "tcp", 100, 200),
            TransportStats("buffer", "tcp", 0, 0, 0, 1),
        ],
    )
    w1 = WorkerStats(
        "w-1",
        [
            ActorStats("a-1", "gen[1]", 0, 0, [EndpointStats("go", 5, 0)]),
            ActorStats("a-9", "lost[0]", 0, 0, []),  # the head does not know it (any more)
        ],
        [TransportStats("stream", "tcp", 1, 2), TransportStats("bulk", "shm", 64, 0, 1)],
    )
    text = render(cluster_families(state, [w0, w1], ScrapeReport(3, 2, 5)))
    s, types = parse(text)
    who = {"mesh": "gen", "mesh_id": "m-1"}
    assert value(s, "orchestr_calls_total", **who, actor="gen[0]", endpoint="go") == 10
    assert value(s, "orchestr_call_errors_total", **who, actor="gen[0]", endpoint="go") == 2
    assert value(s, "orchestr_calls_total", **who, actor="gen[1]", endpoint="go") == 5
    assert value(s, "orchestr_queue_depth", **who, actor="gen[0]") == 3
    assert value(s, "orchestr_calls_in_flight", **who, actor="gen[0]") == 1
    assert value(s, "orchestr_queue_depth", mesh="", mesh_id="", actor="lost[0]") == 0
    tcp = {"kind": "stream", "transport": "tcp"}
    assert value(s, "orchestr_transport_bytes_total", **tcp, direction="sent") == 101
    assert value(s, "orchestr_transport_bytes_total", **tcp, direction="received") == 202
    assert value(s, "orchestr_transport_ops_total", kind="bulk", transport="shm") == 1
    assert value(s, "orchestr_transport_fallbacks_total", transport="tcp") == 1
    assert value(s, "orchestr_nodes", state="alive") == 1
    assert value(s, "orchestr_nodes", state="dead") == 1
    assert value(s, "orchestr_actors", state="alive") == 2
    assert value(s, "orchestr_actors", state="dead") == 1
    assert value(s, "orchestr_actors", state="restarting") == 0
    assert value(s, "orchestr_actor_restarts_total", mesh="gen", mesh_id="m-1") == 2
    assert value(s, "orchestr_node_resources_free", node="n1", resource="cpu") == 2.0
    assert value(s, "orchestr_node_resources_capacity", node="n1", resource="cpu") == 4.0
    assert not matching(s, "orchestr_node_resources_free", node="n2")  # dead: left out
    assert value(s, "orchestr_scrape_workers", result="failed") == 1
    assert value(s, "orchestr_scrape_errors_total") == 5
    assert types["orchestr_calls_total"] == "counter" and types["orchestr_nodes"] == "gauge"


def test_worker_stats_survive_protobuf() -> None:
    made = [
        metrics.MetricSnapshot("t_c", "counter", "c", (), [({"a": "1"}, 3.0, [])]),
        metrics.MetricSnapshot("t_h", "histogram", "h", (0.5, 2.0), [({}, 4.5, [1, 0, 2])]),
    ]
    stats = WorkerStats(
        "w-1",
        [ActorStats("a-1", "gen[1]", 4, 1, [EndpointStats("go", 5, 1)])],
        [TransportStats("buffer", "rdma", 1 << 40, 7, 3, 1)],
        made,
    )
    assert worker_stats_from_pb(worker_stats_to_pb(stats)) == stats


# -- metrics actors make (orchestr.metrics) -----------------------------------------------------


def test_actor_metrics_record_and_refuse_bad_use() -> None:
    c = metrics.Counter("unit_requests", "Requests.", ("route",))
    c.inc(tags={"route": "a"})
    c.inc(2.5, {"route": "a"})
    assert metrics.Counter("unit_requests", "again", ("route",)).name == "unit_requests"
    h = metrics.Histogram("unit_seconds", "Seconds.", [0.1, 1.0])
    for v in (0.05, 0.1, 0.5, 7.0):
        h.observe(v)
    g = metrics.Gauge("unit_depth", "Depth.")
    g.set(3)
    g.set(1)
    got = {m.name: m for m in metrics.snapshot()}
    assert got["unit_requests"].series == [({"route": "a"}, 3.5, [])]
    assert got["unit_seconds"].series == [({}, 7.65, [2, 1, 1])]  # le 0.1 takes 0.1 itself
    assert got["unit_depth"].series == [({}, 1.0, [])]
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: metrics.Counter("unit_requests", "", ("other",)), "exists already as a counter"),
        (lambda: metrics.Gauge("unit_requests"), "exists already as a counter"),
        (lambda: metrics.Histogram("unit_seconds", "", [0.1, 2.0]), "boundaries"),
        (lambda: metrics.Counter("orchestr_mine"), "the orchestr_ prefix"),
        (lambda: metrics.Counter("1bad"), "not a valid metric name"),
        (lambda: metrics.Counter("unit_x", "", ("le-x",)), "not a valid tag key"),
        (lambda: metrics.Counter("unit_x", "", "route"), "the string 'route'"),
        (lambda: metrics.Histogram("unit_y", "", []), "needs finite boundaries"),
        (lambda: metrics.Histogram("unit_y", "", [1.0, 1.0]), "increase strictly"),
        (lambda: c.inc(-1, {"route": "a"}), "only goes up"),
        (lambda: c.inc(1, {"path": "a"}), r"takes tags \['route'\], got \['path'\]"),
        (lambda: h.observe(math.nan), "finite values"),
    ]
    for make, match in cases:
        with pytest.raises(ValueError, match=match):
            make()


def test_actor_metrics_sum_over_workers_and_a_bad_one_is_left_out() -> None:
    def worker(*made: metrics.MetricSnapshot) -> WorkerStats:
        return WorkerStats("w", [], [], list(made))

    answers = [
        worker(
            metrics.MetricSnapshot("vllm:hits", "counter", "Hits.", (), [({"m": "x"}, 2.0, [])]),
            metrics.MetricSnapshot("lat", "histogram", "Lat.", (0.5,), [({}, 0.75, [1, 1])]),
        ),
        worker(
            metrics.MetricSnapshot("vllm:hits", "counter", "Hits.", (), [({"m": "x"}, 3.0, [])]),
            metrics.MetricSnapshot("lat", "histogram", "Lat.", (0.5,), [({}, 0.25, [1, 0])]),
            metrics.MetricSnapshot("lat", "gauge", "another kind", (), [({}, 1.0, [])]),
            metrics.MetricSnapshot("bad name", "gauge", "", (), [({}, 1.0, [])]),
            metrics.MetricSnapshot("orchestr_nodes", "gauge", "", (), [({}, 9.0, [])]),
            metrics.MetricSnapshot("badtag", "gauge", "", (), [({"le": "1"}, 1.0, [])]),
        ),
    ]
    samples, types = parse(render(actor_families(answers)))
    assert types == {"vllm:hits_total": "counter", "lat": "histogram"}
    assert value(samples, "vllm:hits_total", m="x") == 5.0
    assert value(samples, "lat_bucket", le="0.5") == 2.0
    assert value(samples, "lat_bucket", le="+Inf") == 3.0
    assert value(samples, "lat_count") == 3.0 and value(samples, "lat_sum") == 1.0


async def test_a_scrape_shows_the_metrics_actors_made(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Metered, n=2, name="metered")
    await mesh[0].serve.call_one("a", 0.05, 3)
    await mesh[1].serve.call_one("a", 0.5, 4)
    await mesh[1].serve.call_one("b", 5.0, 2)
    for _ in range(20):  # a worker slow to answer is left out of a scrape (and counted)
        s, _ = await scrape(ctx)
        if not value(s, "orchestr_scrape_workers", result="failed"):
            break
    assert value(s, "test_served_total", route="a") == 2.0  # over both workers
    assert value(s, "test_served_total", route="b") == 1.0
    assert value(s, "test_seconds_bucket", route="a", le="0.1") == 1.0
    assert value(s, "test_seconds_bucket", route="a", le="1.0") == 2.0
    assert value(s, "test_seconds_count", route="b") == 1.0
    assert value(s, "test_seconds_sum", route="a") == pytest.approx(0.55)
    assert value(s, "test_depth", member="0") == 3.0 and value(s, "test_depth", member="1") == 2.0


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 200),
        (b"GET /metrics?name[]=x HTTP/1.0\r\n\r\n", 200),
        (b"POST /metrics HTTP/1.1\r\n\r\n", 405),
        (b"HEAD /metrics HTTP/1.1\r\n\r\n", 405),
        (b"GET / HTTP/1.1\r\n\r\n", 404),
        (b"GET /metricsx HTTP/1.1\r\n\r\n", 404),
        (b"\x16\x03\x01garbage\r\n\r\n", 400),
        (b"GET /metrics\r\n\r\n", 400),
        (b"GET /metrics HTTP/2.0\r\n\r\n", 400),
    ],
)
def test_route(head: bytes, status: int) -> None:
    assert route(head) == status


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        (b"", 401),
        (b"Authorization: Bearer nope\r\n", 401),
        (b"Authorization: Basic s3cret\r\n", 401),
        (b"Authorization: Bearer s3cret\r\n", 200),
        (b"authorization:Bearer s3cret  \r\n", 200),
    ],
)
def test_route_with_a_metrics_token(headers: bytes, status: int) -> None:
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"
    assert route(head, "s3cret") == status
    assert route(b"GET /nope HTTP/1.1\r\n\r\n", "s3cret") == 404  # no token needed to learn


def test_metrics_port_setting() -> None:
    assert load_config({}).metrics_port == 0
    assert load_config({"ORCHESTR_METRICS_PORT": "-1"}).metrics_port == -1
    assert load_config({"ORCHESTR_METRICS_PORT": "9464"}).metrics_port == 9464
    for bad in ("-2", "65536"):
        with pytest.raises(ConfigError, match="metrics_port must be from -1 to 65535"):
            load_config({"ORCHESTR_METRICS_PORT": bad})
    with pytest.raises(ConfigError, match="ORCHESTR_METRICS_PORT"):
        load_config({"ORCHESTR_METRICS_PORT": "any"})


# -- a real cluster, scraped over loopback -------------------------------------------------------


async def scrape(ctx: oc.JobContext) -> tuple[Samples, str]:
    def get() -> tuple[str, str]:
        with urllib.request.urlopen(f"http://{ctx.metrics_address}/metrics", timeout=10) as r:
            return r.read().decode(), r.headers["Content-Type"]

    text, content_type = await asyncio.to_thread(get)
    return parse(text)[0], content_type


async def exchange(address: str | None, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` raw, read the answer until the server closes; status, headers, body."""
    assert address is not None
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        async with asyncio.timeout(10):
            raw = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines)
    assert int(headers["Content-Length"]) == len(body)
    return int(status_line.split(" ")[1]), headers, body


async def test_a_scrape_counts_the_calls_errors_and_bytes(ctx: oc.JobContext) -> None:
    assert ctx.metrics_address is not None and ctx.metrics_address.startswith("127.0.0.1:")
    mesh = await ctx.spawn(Counter, n=2, name="counters")
    for _ in range(5):
        await mesh[0].add.call_one(1)
    await mesh.add.call(1)
    for _ in range(2):
        with pytest.raises(oc.ActorError):
            await mesh[1].fail.call_one("no")
    with pytest.raises(oc.ActorError):
        await mesh[1].add.call_one(1, 2, 3)  # does not fit the signature
    await mesh[0].tensor_sum.call_one(np.ones(1 << 19, dtype=np.float32))  # 2 MiB

    s, content_type = await scrape(ctx)
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    mesh_id = mesh.mesh_id
    r0 = {"mesh": "counters", "mesh_id": mesh_id, "actor": "counters[0]"}
    r1 = {**r0, "actor": "counters[1]"}
    assert value(s, "orchestr_calls_total", **r0, endpoint="add") == 6
    assert value(s, "orchestr_call_errors_total", **r0, endpoint="add") == 0
    assert value(s, "orchestr_calls_total", **r1, endpoint="add") == 2
    assert value(s, "orchestr_call_errors_total", **r1, endpoint="add") == 1
    assert value(s, "orchestr_calls_total", **r1, endpoint="fail") == 2
    assert value(s, "orchestr_call_errors_total", **r1, endpoint="fail") == 2
    assert value(s, "orchestr_calls_total", **r0, endpoint="tensor_sum") == 1
    assert value(s, "orchestr_queue_depth", **r0) == 0
    assert value(s, "orchestr_actors", state="alive") == 2
    assert value(s, "orchestr_nodes", state="alive") == 1
    assert value(s, "orchestr_actor_restarts_total", mesh="counters", mesh_id=mesh_id) == 0
    assert value(s, "orchestr_scrape_workers", result="answered") == 2
    assert value(s, "orchestr_scrape_errors_total") == 0
    stream = {"kind": "stream", "transport": "tcp"}
    assert value(s, "orchestr_transport_bytes_total", **stream, direction="received") > 0
    assert value(s, "orchestr_transport_bytes_total", **stream, direction="sent") > 0
    bulk = {"kind": "bulk", "transport": "shm"}
    assert value(s, "orchestr_transport_bytes_total", **bulk, direction="received") >= 2 << 20
    assert matching(s, "orchestr_node_resources_free", resource="cpu")


async def test_queue_depth_shows_calls_waiting(ctx: oc.JobContext) -> None:
    mesh = await ctx.spawn(Counter)
    await mesh.get.call_one()  # connected
    calls = [asyncio.ensure_future(mesh.sleep.call_one(d)) for d in (1.5, 0, 0, 0)]
    await asyncio.sleep(0.1)  # the first sleeps, three wait behind it
    s, _ = await scrape(ctx)
    who = {"mesh": "Counter", "mesh_id": mesh.mesh_id, "actor": "Counter[0]"}
    assert value(s, "orchestr_queue_depth", **who) == 3
    assert value(s, "orchestr_calls_in_flight", **who) == 1
    await asyncio.gather(*calls)


@pytest.fixture
async def quick_ctx(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[oc.JobContext]:
    """A cluster whose metrics endpoint gives up on silent clients and workers quickly."""
    monkeypatch.setattr(_metrics, "READ_TIMEOUT", 0.5)
    monkeypatch.setattr(_metrics, "SCRAPE_TIMEOUT", 0.5)
    async with open_cluster() as job:
        yield job


async def test_bad_requests_get_answers_and_the_head_keeps_serving(
    quick_ctx: oc.JobContext,
) -> None:
    ctx = quick_ctx
    address = ctx.metrics_address
    mesh = await ctx.spawn(Counter)
    await mesh.add.call_one(1)
    host, _, port = str(address).rpartition(":")
    silent = await asyncio.open_connection(host, int(port))  # sends nothing at all
    try:
        status, headers, _ = await exchange(address, b"POST /metrics HTTP/1.1\r\n\r\nbody")
        assert status == 405 and headers["Allow"] == "GET"
        assert (await exchange(address, b"GET /nope HTTP/1.1\r\n\r\n"))[0] == 404
        assert (await exchange(address, b"\x16\x03\x01\x00\xa5garbage\r\n\r\n"))[0] == 400
        big = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * 20_000 + b"\r\n\r\n"
        assert (await exchange(address, big))[0] == 431
        s, _ = await scrape(ctx)  # served while the silent client is still connected
        assert matching(s, "orchestr_calls_total", actor="Counter[0]", endpoint="add") == [1]
        async with asyncio.timeout(5):
            answer = await silent[0].read()
        assert answer.startswith(b"HTTP/1.1 408 ")
    finally:
        silent[1].close()
    status, _, body = await exchange(address, b"GET /metrics HTTP/1.1\r\n\r\n")
    assert status == 200 and b"orchestr_nodes" in body


async def test_a_worker_that_does_not_answer_is_skipped(quick_ctx: oc.JobContext) -> None:
    ctx = quick_ctx
    mesh = await ctx.spawn(Counter, n=2, name="c")
    await mesh.add.call(1)
    pid = (await mesh[1].whoami.call_one())["pid"]
    doomed = await ctx.spawn(ExitsAtOnce, name="doomed", supervise="handle")
    with pytest.raises(oc.ActorDiedError):
        await doomed.die.call_one(3)

    os.kill(pid, signal.SIGSTOP)
    try:
        s, _ = await scrape(ctx)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert value(s, "orchestr_scrape_workers", result="answered") == 1
    assert value(s, "orchestr_scrape_workers", result="failed") == 1
    assert value(s, "orchestr_scrape_errors_total") == 1
    assert matching(s, "orchestr_calls_total", actor="c[0]", endpoint="add") == [1]
    assert not matching(s, "orchestr_calls_total", actor="c[1]")
    assert value(s, "orchestr_actors", state="dead") == 1  # the dead worker is not asked

    s, _ = await scrape(ctx)
    assert value(s, "orchestr_scrape_workers", result="answered") == 2
    assert value(s, "orchestr_scrape_errors_total") == 1
    assert matching(s, "orchestr_calls_total", actor="c[1]", endpoint="add") == [1]


async def test_metrics_can_be_turned_off() -> None:
    async with open_cluster(load_config(metrics_port=-1)) as ctx:
        assert ctx.metrics_address is None
