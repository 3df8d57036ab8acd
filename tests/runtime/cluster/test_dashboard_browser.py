"""The dashboard in a real browser (headless Chromium driven by Playwright) against a real head
with two nodes, a fabric manager and a running job: the login, then each page live, following
an actor's kill and restart, a simulated generator's serving figures, the job's phases and RL
curves and the fabric's circuits, without reloading. A screenshot of each page is kept in
``build/test-artefacts/dashboard/``.

Chromium is Debian's (``make setup-browser`` installs it; Playwright's own download is not
reachable here). Without it the test is skipped, saying so, unless
``ORCHESTR_REQUIRE_BROWSER`` is set (CI sets it: there it fails instead)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import orchestr as oc
from orchestr._cluster._dashboard._app import NONE
from orchestr._cluster._fabric import open_fabric
from orchestr._cluster._head import HeadService
from orchestr._cluster._node import NodeService
from orchestr._job._session import job_session
from orchestr.roles import Generator, Request, models
from orchestr.roles.generator import StepTimeModel
from tests.runtime.actors import Counter

ROOT = Path(__file__).resolve().parents[3]
PLAN = ROOT / "examples" / "fabric" / "small.toml"
SHOTS = ROOT / "build" / "test-artefacts" / "dashboard"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
HAVE_CHROMIUM = os.path.exists(CHROMIUM)
TOKEN = "browser-test-token-0123456789abcdef"
BIG = 500 * 10**9  # bytes: a circuit beats the OCS's reconfiguration cost for this much
#: Milliseconds a page has to show what the cluster just did (live, through its stream).
LIVE_MS = 20_000
# as root, Chromium runs only without its sandbox; the rest keeps it off this closed network
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
async def head() -> AsyncIterator[HeadService]:
    if not HAVE_CHROMIUM:
        if os.environ.get("ORCHESTR_REQUIRE_BROWSER"):
            pytest.fail(f"no Chromium at {CHROMIUM}: make setup-browser installs Debian's")
        pytest.skip(f"no Chromium at {CHROMIUM}: make setup-browser installs Debian's")
    config = dataclasses.replace(
        oc.load_config(), dashboard_port=0, metrics_token=TOKEN, restart_wait=30.0
    )
    async with HeadService("token", config) as service:
        service.fabric = open_fabric(PLAN)
        async with (
            NodeService(service.address, "token", config, labels={"fabric_host": "h0"}),
            NodeService(service.address, "token", config, labels={"fabric_host": "h2"}),
        ):
            yield service


async def test_the_pages_follow_a_running_job(head: HeadService, tmp_path: Path) -> None:
    from playwright.async_api import async_playwright, expect

    SHOTS.mkdir(parents=True, exist_ok=True)
    url = f"http://{head.dashboard_address}"
    config = dataclasses.replace(oc.load_config(), dashboard_port=0, metrics_token=TOKEN)
    async with (
        job_session(head.address, "token", config) as ctx,
        async_playwright() as pw,
    ):
        head.dashboard.watch_job(ctx.job_id, "test_the_pages_follow_a_running_job", ctx.session_dir)
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(LIVE_MS)
            expect.set_options(timeout=LIVE_MS)

            # the login: the form, then the page asked for
            await page.goto(f"{url}/actors")
            await expect(page).to_have_url(f"{url}/login?next=/actors")
            await page.fill("#token", "not the token")
            await page.click("button[type=submit]")
            await expect(page.get_by_role("alert")).to_contain_text("not this head's token")
            await page.fill("#token", TOKEN)
            await page.click("button[type=submit]")
            await expect(page).to_have_url(f"{url}/actors")

            # an actor appears, is killed and comes back, all on the open page
            victim = await ctx.spawn(
                Counter, name="victim", restart=oc.RestartPolicy(max_restarts=1)
            )
            row = page.locator('[data-actor="victim[0]"]')
            await expect(row).to_have_attribute("data-state", "alive")
            (pid,) = [a.pid for a in head.state.actors.values() if a.name == "victim"]
            async with ctx.phase("generation"):
                os.kill(pid, signal.SIGKILL)
                await expect(row).to_have_attribute("data-restarts", "1")
                await expect(row).to_have_attribute("data-state", "alive")
            assert await victim.add.call_one(2) == 2  # the restarted one serves
            await page.screenshot(path=SHOTS / "actors.png", full_page=True)

            # a simulated generator serves; its figures show
            folder = models.make_tiny("llama", tmp_path / "llama", vocab=301)
            profile = tmp_path / "profile.json"
            profile.write_text(json.dumps(StepTimeModel(base_s=2e-3, decode_s=1e-4).to_json()))
            gen = await ctx.spawn(
                Generator,
                name="gen",
                checkpoint=str(folder),
                engine="sim",
                profile=str(profile),
                kv={"num_blocks": 64, "block_size": 4},
            )
            await page.goto(f"{url}/serving")
            shared = list(range(3, 23))
            for i in range(3):
                await gen.generate.call_one(
                    [Request(f"r{i}{j}", [*shared, j], 6) for j in range(4)]
                )
            engine = page.locator('[data-engine="gen[0]"]')
            await expect(engine.locator("td").nth(3)).not_to_have_text(f"{NONE} / {NONE}")
            await expect(engine.locator("td").nth(6)).not_to_have_text(NONE)  # prefix hits
            await page.screenshot(path=SHOTS / "serving.png", full_page=True)

            # the job's phases, marks and RL curves; the fabric's circuits for a phase
            for step in range(12):
                async with ctx.phase("training"):
                    ctx.events.record(
                        "rl_step", step=step, reward=step / 12, mean_length=20 - step, accuracy=None
                    )
            await ctx.spawn(Counter, n=2, strategy="STRICT_SPREAD", name="ring")
            await page.goto(f"{url}/jobs/{ctx.job_id}")
            traffic = oc.Collective("broadcast", "ring", BIG)
            async with ctx.phase("weight_sync", traffic=traffic):
                pass
            await expect(page.locator('[data-curve="reward"]')).to_contain_text("last 0.917")
            await expect(page.locator('[data-kind="restart"]')).to_have_count(1)
            bars = page.locator("svg.timeline rect.bar title")
            await expect(bars.filter(has_text=re.compile("^weight_sync:"))).to_have_count(1)
            await expect(bars.filter(has_text="circuits for weight_sync")).to_have_count(1)
            await expect(bars.filter(has_text=re.compile("^training:"))).to_have_count(12)
            await page.screenshot(path=SHOTS / "job.png", full_page=True)
            await page.goto(f"{url}/jobs")
            await expect(page.locator(f'[data-job="{ctx.job_id}"]')).to_have_attribute(
                "data-state", "running"
            )
            await page.screenshot(path=SHOTS / "jobs.png", full_page=True)
            await page.goto(f"{url}/fabric")
            await expect(page.locator('[data-ocs="ocs0"]')).to_contain_text("tor0 ↔ tor1")
            await expect(page.locator("#plans")).to_contain_text("weight_sync")
            await page.screenshot(path=SHOTS / "fabric.png", full_page=True)
            await page.goto(f"{url}/")
            await expect(page.locator("#nodes tbody tr")).to_have_count(2)
            await page.screenshot(path=SHOTS / "nodes.png", full_page=True)

            # logged out, the pages ask for the token again
            await page.click("text=Log out")
            await expect(page).to_have_url(f"{url}/login")
            await asyncio.sleep(0)
        finally:
            await browser.close()
    assert sorted(p.name for p in SHOTS.glob("*.png")) == [
        "actors.png",
        "fabric.png",
        "job.png",
        "jobs.png",
        "nodes.png",
        "serving.png",
    ]
