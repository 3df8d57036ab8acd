"""The front door fuzzed from its own OpenAPI document: schemathesis reads ``/openapi.json``
from a server on loopback and sends, for every route, bodies that fit the document and (for
routes with a body) bodies that break it. No answer may be a server error or a hang, each
answer must be one the document lists (status, headers, content type, JSON body or each
event of a stream), a body that breaks the document must be refused (4xx), and the server
still answers normally afterwards. (A body that fits the document may still be refused: the
document cannot say that a prompt and its ``max_tokens`` together fit the context.)

Generation stays short: a valid ``max_tokens`` or ``n`` above a few (the document allows up
to the context, and 128) is cut to a few before it is sent, and a cut value still fits the
document. Hypothesis runs derandomized with a fixed number of examples, so a run repeats."""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import httpx2
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Err, Ok
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.routing import Route

import orchestr as oc
from orchestr.roles.serving import FrontDoor, ServedModel, openai_app
from orchestr.roles.serving._openai import (
    MAX_N,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TOP_LOGPROBS,
    NEUTRAL,
)
from orchestr.roles.serving._schema import openapi_document

from .test_frontdoor import folder, served, spawn

__all__ = ["folder"]  # the module's checkpoint fixture, shared with test_frontdoor

pytestmark = pytest.mark.timeout(180)

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: Examples per route: bodies that fit the document, and bodies that break it.
EXAMPLES = {GenerationMode.POSITIVE: 25, GenerationMode.NEGATIVE: 25}
#: Seconds an answer may take before the request counts as a hang.
ANSWER_S = 20.0
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,  # what the document refuses, the server refuses
]


def short(case: Any) -> Any:
    """``case`` with generation kept to a few tokens and choices: a valid ``max_tokens``,
    ``max_completion_tokens`` or ``n`` above a few is cut (a chat without either gets 4);
    anything invalid is left as generated."""
    body = case.body
    if not isinstance(body, dict):
        return case

    def valid(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    for name, most in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 2)):
        if valid(body.get(name)) and body[name] > most:
            body[name] = most
    if "messages" in body and body.get("max_tokens") is None:
        if body.get("max_completion_tokens") is None:
            body["max_tokens"] = 4
    return case


def described(case: Any) -> str:
    body = repr(case.body)
    return f"{case.method} {case.path} {body[:600]}{'...' if len(body) > 600 else ''}"


def fuzz(url: str) -> list[str]:
    """Every operation of the served document, fuzzed; the failures, each with its request.
    Blocks (run it in a thread)."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=AUTH, timeout=10)
    failures: list[str] = []
    with requests.Session() as session:
        for result in schema.get_all_operations():
            if isinstance(result, Err):
                failures.append(f"an operation of the document is invalid: {result.err()}")
                continue
            operation = result.ok()
            modes = [GenerationMode.POSITIVE]
            if operation.body:
                modes.append(GenerationMode.NEGATIVE)
            for mode in modes:
                examples(operation, mode, url, session, failures)
    return failures


def examples(
    operation: Any, mode: GenerationMode, url: str, session: requests.Session, failures: list[str]
) -> None:
    @settings(
        max_examples=EXAMPLES[mode],
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # a failure is recorded, not shrunk
        suppress_health_check=list(HealthCheck),
    )
    # the key given, so the negative examples break the body, not the Authorization header
    @given(case=operation.as_strategy(generation_mode=mode, headers=AUTH).map(short))
    def one(case: Any) -> None:
        try:
            response = case.call(base_url=url, session=session, timeout=ANSWER_S)
        except requests.Timeout:
            failures.append(f"no answer in {ANSWER_S:.0f} s: {described(case)}")
            return
        except requests.ConnectionError as exc:
            failures.append(f"connection failed ({exc}): {described(case)}")
            return
        try:
            case.validate_response(response, checks=CHECKS)
        except (AssertionError, BaseExceptionGroup) as exc:  # the checks' failures
            status = response.status_code
            failures.append(f"{status} {response.text[:300]!r}: {exc}\n  {described(case)}")

    one()


def test_the_document_takes_its_bounds_from_the_checks() -> None:
    doc = openapi_document(["tiny", "alias"], 64, 96)
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    fields = body["schema"]["properties"]
    assert fields["model"]["enum"] == ["tiny", "alias", None]
    assert fields["n"]["maximum"] == MAX_N and fields["logprobs"]["maximum"] == MAX_TOP_LOGPROBS
    assert fields["max_tokens"] | {"description": ""} == {
        "type": "integer",
        "minimum": 1,
        "maximum": 63,
        "nullable": True,
        "description": "",
    }
    strings, lists = fields["stop"]["anyOf"]
    assert strings["maxLength"] == MAX_STOP_CHARS and lists["maxItems"] == MAX_STOPS
    tokens = fields["prompt"]["anyOf"][2]
    assert (tokens["items"]["maximum"], tokens["maxItems"]) == (95, 63)
    assert set(NEUTRAL) <= set(fields)  # every field accepted at its neutral value only
    assert doc["paths"]["/health"]["get"]["security"] == []
    loaded = schemathesis.openapi.from_dict(doc)
    assert all(isinstance(r, Ok) for r in loaded.get_all_operations())


async def test_the_front_door_survives_its_own_document_fuzzed(
    ctx: oc.JobContext, folder: pathlib.Path
) -> None:
    gen = await spawn(ctx, folder, 1)
    model = ServedModel(folder, ["tiny"])
    front = FrontDoor(gen)
    app = openai_app(front, model, api_key=KEY)
    # every route of the app is in the document, and nothing else
    doc = openapi_document(model.names, model.max_len, model.vocab_size)
    served_routes = {
        (r.path, m.lower())
        for r in app.routes
        if isinstance(r, Route) and r.path != "/openapi.json"
        for m in r.methods or ()
        if m != "HEAD"
    }
    documented = {(path, m) for path, operations in doc["paths"].items() for m in operations}
    assert served_routes == documented
    async with front, served(app) as url:
        failures = await asyncio.to_thread(fuzz, url)
        # and afterwards it serves as before
        async with httpx2.AsyncClient(base_url=url, headers=AUTH, timeout=30) as h:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
            r = await h.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
            assert (await h.get("/health")).status_code == 200
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures)
