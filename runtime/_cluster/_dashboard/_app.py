"""The dashboard's web app (Starlette): its pages, the login, the live stream and the assets.

Pages (``GET``): ``/`` the nodes, ``/actors`` the meshes and their members, ``/jobs`` and
``/jobs/{id}`` the jobs with their phase timeline and, for RL runs, the reward and length
curves, ``/serving`` the generators' rates and latencies, ``/fabric`` the circuits and the
last reconfiguration. Each page is whole when served (it reads without JavaScript) and then
follows ``/stream/{page}``, server-sent events whose ``page`` event carries the page's body
anew when it changed; htmx's SSE extension swaps it in. Every asset is served from
``/static/`` (htmx and its SSE extension are vendored: ``static/VENDORED.md``).

With a token (``Config.metrics_token``, the one ``GET /metrics`` asks for) every route but
``/login``, ``/static/`` and ``/healthz`` needs either ``Authorization: Bearer <token>`` or
the session cookie the login form sets: an HMAC of a fixed text keyed by the token, so the
browser never holds the token itself, and the cookie is ``HttpOnly`` and ``SameSite=Strict``.
The token travels only in the login form's body, which nothing logs (uvicorn's access log is
off). Without a token (an embedded cluster's head, as for ``/metrics``) the pages are open.
Responses carry a content security policy that allows only this origin's scripts and styles.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import jinja2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    HTMLResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

__all__ = ["COOKIE", "NONE", "PAGES", "dashboard_app", "session_value"]

HERE = Path(__file__).parent
COOKIE = "orchestr_dashboard"
#: What a figure not known yet shows as.
NONE = "\N{EN DASH}"
#: Pages by route name: their path and title.
PAGES = {
    "nodes": ("/", "Nodes"),
    "actors": ("/actors", "Actors"),
    "jobs": ("/jobs", "Jobs"),
    "serving": ("/serving", "Serving"),
    "fabric": ("/fabric", "Fabric"),
}
#: Largest login form body read, in bytes.
MAX_FORM_BYTES = 4096
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

#: Builds a page's template context: (page, job id or "") -> context, or None for no such job.
Render = Callable[[str, str], Awaitable[dict[str, Any] | None]]


def session_value(token: str) -> str:
    """The session cookie's value for ``token``: it proves the login without being the token."""
    return hmac.new(token.encode(), b"orchestr dashboard session v1", hashlib.sha256).hexdigest()


def _templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["ms"] = lambda s: NONE if s is None else f"{s * 1000:.1f}"
    env.filters["pct"] = lambda v: NONE if v is None else f"{v * 100:.1f}%"
    env.filters["num"] = lambda v, digits=1: NONE if v is None else f"{v:.{digits}f}"
    env.filters["clock"] = lambda t: time.strftime("%H:%M:%S", time.localtime(t)) if t else NONE
    env.globals["pages"] = PAGES
    return env


def dashboard_app(
    token: str,
    render: Render,
    refresh_s: float,
    closing: asyncio.Event,
    *,
    secure: bool = False,
) -> Starlette:
    """The app; ``render`` builds each page's data, ``refresh_s`` is how often a stream looks
    for a change, ``closing`` ends every stream (the server is stopping), and ``secure``
    (served over HTTPS) keeps the session cookie to HTTPS."""
    env = _templates()
    cookie = session_value(token) if token else ""

    def authorized(request: Request) -> bool:
        if not token:
            return True
        presented = request.headers.get("authorization", "")
        if hmac.compare_digest(presented.encode(), f"Bearer {token}".encode()):
            return True
        return hmac.compare_digest(request.cookies.get(COOKIE, "").encode(), cookie.encode())

    def html(name: str, status: int = 200, **context: Any) -> HTMLResponse:
        body = env.get_template(name).render(**context)
        return HTMLResponse(body, status_code=status, headers=HEADERS)

    async def page(request: Request) -> Response:
        name = request.scope["route"].name
        job = request.path_params.get("job", "")
        if not authorized(request):
            target = urllib.parse.quote(request.url.path, safe="/")
            return RedirectResponse(f"/login?next={target}", status_code=303, headers=HEADERS)
        data = await render(name, job)
        if data is None:
            return html("missing.html", 404, what=f"job {job}", page=name)
        query = f"?job={urllib.parse.quote(job)}" if job else ""
        return html(
            "page.html", page=name, stream=f"/stream/{name}{query}", body=f"{name}.html", **data
        )

    async def stream(request: Request) -> Response:
        if not authorized(request):
            return PlainTextResponse("log in first\n", 401, headers=HEADERS)
        name = request.path_params["page"]
        job = request.query_params.get("job", "")
        if name not in PAGES and name != "job":
            return PlainTextResponse(f"no page {name!r}\n", 404, headers=HEADERS)
        return StreamingResponse(
            _events(env, render, name, job, refresh_s, closing),
            media_type="text/event-stream",
            headers={**HEADERS, "X-Accel-Buffering": "no"},
        )

    async def login(request: Request) -> Response:
        target = _safe_next(request.query_params.get("next", "/"))
        if request.method == "GET":
            return html("login.html", page="login", target=target, failed=False)
        body = await _read_form(request)
        if body is None:
            return PlainTextResponse("a login form is at most 4 KiB\n", 413, headers=HEADERS)
        given = body.get("token", "")
        if token and hmac.compare_digest(given.encode(), token.encode()):
            response = RedirectResponse(target, status_code=303, headers=HEADERS)
            response.set_cookie(
                COOKIE, cookie, httponly=True, samesite="strict", path="/", secure=secure
            )
            return response
        return html("login.html", 401, page="login", target=target, failed=True)

    async def logout(request: Request) -> Response:
        response = RedirectResponse("/login", status_code=303, headers=HEADERS)
        response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
        return response

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok\n", headers=HEADERS)

    routes: list[BaseRoute] = [
        Route(path, page, name=name, methods=["GET"]) for name, (path, _) in PAGES.items()
    ]
    routes += [
        Route("/jobs/{job}", page, name="job", methods=["GET"]),
        Route("/stream/{page}", stream, methods=["GET"]),
        Route("/login", login, methods=["GET", "POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    return Starlette(routes=routes)


async def _events(
    env: jinja2.Environment,
    render: Render,
    name: str,
    job: str,
    refresh_s: float,
    closing: asyncio.Event,
) -> AsyncIterator[str]:
    """The stream of one page: its body each time it changed, a comment every so often to
    keep proxies from closing an idle stream, until the client goes or the server stops."""
    template = env.get_template(f"{name}.html")
    sent = ""
    quiet = 0.0
    while not closing.is_set():
        data = await render(name, job)
        if data is None:
            yield "event: gone\ndata: gone\n\n"
            return
        body = template.render(page=name, **data)
        if body != sent:
            sent, quiet = body, 0.0
            yield "event: page\n" + "".join(f"data: {line}\n" for line in body.split("\n")) + "\n"
        elif quiet >= 15.0:
            quiet = 0.0
            yield ": still here\n\n"
        try:
            await asyncio.wait_for(closing.wait(), refresh_s)
        except TimeoutError:
            quiet += refresh_s


def _safe_next(target: str) -> str:
    """Where a login leads: a path on this server, never another site."""
    if not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


async def _read_form(request: Request) -> dict[str, str] | None:
    """A url-encoded form's fields (the first of each name); ``None`` past the size limit."""
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_FORM_BYTES:
            return None
        chunks.append(chunk)
    fields = urllib.parse.parse_qs(b"".join(chunks).decode("utf-8", "replace"))
    return {k: v[0] for k, v in fields.items()}
