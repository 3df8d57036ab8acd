"""Rule: a daemon head's dashboard shows nothing to a user without its metrics token. Another
local user gets only the login form: no page, no live stream, no asset path out of the static
folder, no session from a forged or guessed cookie, and the token file stays unreadable to
it. The token a real login gives never appears in the head's logs."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import urllib.error
import urllib.parse
import urllib.request

import pytest

import orchestr as oc
from orchestr._cluster._dashboard._app import session_value
from orchestr._cluster._head import HeadService
from orchestr._cluster._node import NodeService
from orchestr._job._session import job_session

from ..cli.test_cluster import cli, state_dir  # noqa: F401 (a fixture)
from .conftest import Attacker

TOKEN = "dashboard-attacker-token-0123456789"


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def _login(url: str, token: str) -> tuple[int, str]:
    """As the operator: log in and read the actors page with the cookie given."""
    opener = urllib.request.build_opener(_NoRedirect)
    body = urllib.parse.urlencode({"token": token}).encode()
    try:
        opener.open(urllib.request.Request(f"{url}/login?next=/actors", data=body), timeout=10)
    except urllib.error.HTTPError as exc:
        assert exc.code == 303, exc.code
        cookie = exc.headers["set-cookie"].split(";")[0]
    request = urllib.request.Request(f"{url}/actors", headers={"Cookie": cookie})
    with opener.open(request, timeout=10) as r:
        return int(r.status), r.read().decode()


@pytest.mark.timeout(120)
async def test_another_user_gets_only_the_login_form(
    state_dir: pathlib.Path,  # noqa: F811
    attacker: Attacker,
) -> None:
    started = await asyncio.to_thread(cli, "start", "--head", "--state-dir", str(state_dir))
    assert started.returncode == 0, started.stderr
    head = json.loads((state_dir / "head.json").read_text())
    address = head["dashboard_address"]
    assert f"dashboard: http://{address}/" in started.stdout
    token_file = state_dir / "metrics-token"
    token = token_file.read_text().strip()
    port = int(address.rpartition(":")[2])
    guessed = session_value("")  # the cookie of an empty token
    forged = "orchestr_dashboard=" + "0" * 64
    report = await attacker.run(
        "http",
        port=port,
        requests=[
            ["GET", "/", {}, ""],
            ["GET", "/actors", {"Cookie": forged}, ""],
            ["GET", "/jobs", {"Cookie": f"orchestr_dashboard={guessed}"}, ""],
            ["GET", "/stream/nodes", {}, ""],
            ["GET", "/stream/nodes", {"Authorization": "Bearer " + "x" * len(token)}, ""],
            ["GET", "/static/../../../metrics-token", {}, ""],
            ["GET", "/static/%2e%2e/_app.py", {}, ""],
            [
                "POST",
                "/login",
                {"Content-Type": "application/x-www-form-urlencoded"},
                "token=guess",
            ],
        ],
        files=[str(token_file), str(state_dir / "logs" / "head.jsonl")],
    )
    home, forged_r, guessed_r, stream, bearer, traversal, encoded, login = report["answers"]
    for answer in (home, forged_r, guessed_r):
        assert answer["status"] == 303 and answer["location"].startswith("/login?next=/")
        assert "data-node" not in answer["body"] and "data-actor" not in answer["body"]
    assert stream["status"] == bearer["status"] == 401
    assert traversal["status"] == encoded["status"] == 404
    assert "import" not in encoded["body"]
    assert login["status"] == 401 and not login["set_cookie"]
    assert report["files"] == {
        str(token_file): "PermissionError",
        str(state_dir / "logs" / "head.jsonl"): "PermissionError",
    }

    # the operator logs in; the token is in none of the head's logs afterwards
    status, page = await asyncio.to_thread(_login, f"http://{address}", token)
    assert status == 200 and "Actors" in page and token not in page
    stopped = await asyncio.to_thread(cli, "stop", "--state-dir", str(state_dir))
    assert stopped.returncode == 0, stopped.stderr
    logs = [p for p in (state_dir / "logs").iterdir() if p.is_file()]
    assert logs and not [p.name for p in logs if token in p.read_text(errors="replace")]


async def test_another_user_reads_no_attached_jobs_log(attacker: Attacker) -> None:
    """A controller that joins from elsewhere sends its event log to the head, which keeps it
    for the dashboard: another user can neither read the head's copy nor see the job's page
    without the token."""
    config = dataclasses.replace(oc.load_config(), dashboard_port=0, metrics_token=TOKEN)
    async with HeadService("token", config) as head, NodeService(head.address, "token", config):
        async with job_session(head.address, "token", config) as ctx:
            async with ctx.phase("secret_phase"):
                pass
        watched = head.dashboard.watched[ctx.job_id]
        log = pathlib.Path(watched.session_dir) / "events.jsonl"
        assert "secret_phase" in await asyncio.to_thread(log.read_text)  # the head has it
        address = head.dashboard_address
        assert address is not None
        report = await attacker.run(
            "http",
            port=int(address.rpartition(":")[2]),
            requests=[["GET", f"/jobs/{ctx.job_id}", {}, ""]],
            files=[str(log), watched.session_dir + "/"],
        )
    (page,) = report["answers"]
    assert page["status"] == 303 and "secret_phase" not in page["body"]
    assert report["files"] == {
        str(log): "PermissionError",
        watched.session_dir + "/": "PermissionError",
    }
