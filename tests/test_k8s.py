"""deploy/k8s rendered offline (`kubectl kustomize`, as `kubectl apply -k` would) and checked against
the services' real flags, routes and metrics: no cluster is needed to catch a manifest that lies."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.api.metrics import _ENGINE_SERIES
from services.api.routes_server import router
from shared.bus import nats_auth
from shared.config import (
    add_agent_args,
    add_engine_args,
    add_nats_arg,
    add_scheduler_args,
    add_worker_args,
)
from shared.control.deploy_config import QaicConfig, convert
from shared.gateway_config import add_api_args

BASE = Path(__file__).parent.parent / "deploy" / "k8s" / "base"
PARSERS = {  # each service's flags, as its __main__ reads them
    "services.api": (add_api_args, add_engine_args, add_nats_arg),
    "services.scheduler": (add_engine_args, add_scheduler_args, add_nats_arg),
    "services.worker": (add_engine_args, add_worker_args, add_nats_arg),
    "services.agent": (add_engine_args, add_worker_args, add_agent_args, add_nats_arg),
    "services.kvcache": (add_nats_arg,),
}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[tuple[str, str], dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (`make test` installs Debian's kubernetes-client)")
    copy = tmp_path_factory.mktemp("k8s") / "base"
    shutil.copytree(BASE, copy)
    subprocess.run([sys.executable, "-m", "shared.bus.nats_auth", str(copy / "auth")], check=True, capture_output=True)
    out = subprocess.run([kubectl, "kustomize", str(copy)], check=True, capture_output=True, text=True).stdout
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(out) if doc}


def _workloads(rendered) -> dict[str, dict]:
    return {name: doc for (kind, name), doc in rendered.items() if kind in ("Deployment", "DaemonSet")}


def _parse(command: list[str]) -> tuple[str, argparse.Namespace]:
    assert command[:2] == ["python", "-m"]
    module = command[2]
    assert importlib.util.find_spec(module) is not None, module
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    for add in PARSERS[module]:
        add(parser)
    return module, parser.parse_args(command[3:])  # an unknown flag raises


def _env(rendered, container: dict) -> dict[str, str]:
    env = {}
    for source in container.get("envFrom", []):
        env |= rendered[("ConfigMap", source["configMapRef"]["name"])]["data"]
    return env | {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def test_every_service_runs_its_module_with_flags_it_reads_and_its_own_bus_login(rendered):
    workloads = _workloads(rendered)
    assert set(workloads) == {"api", "scheduler", "kvcache", "worker-cpu", "worker-cuda", "worker-qaic", "agent"}
    for name, doc in workloads.items():
        spec = doc["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        assert container["image"] == "switchyard:latest", name
        module, _ = _parse(container["command"])
        env = _env(rendered, container)
        user = env["SY_NATS_USER"]
        service = module.split(".")[1]
        assert user == nats_auth.user_of(service) and user in nats_auth.PERMISSIONS, name
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert env["SY_NATS_AUTH_FILE"] == f"{mounts['auth']}/{nats_auth.USERS_FILE}", name
        secret = rendered[("Secret", volumes["auth"]["secret"]["secretName"])]
        assert set(secret["data"]) == {nats_auth.CONF_FILE, nats_auth.USERS_FILE}


def test_the_services_reach_every_nats_node_and_the_stores_are_replicated(rendered):
    nats = rendered[("StatefulSet", "nats")]
    service = rendered[("Service", nats["spec"]["serviceName"])]
    replicas = nats["spec"]["replicas"]
    assert replicas == 3 and service["spec"]["clusterIP"] == "None"
    (container,) = nats["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    client_port = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert "-js" in args and args[args.index("-sd") + 1] == container["volumeMounts"][0]["mountPath"]
    assert nats["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == container["volumeMounts"][0]["name"]
    pods = [f"{nats['metadata']['name']}-{i}.{service['metadata']['name']}" for i in range(replicas)]
    assert args[args.index("--routes") + 1].split(",") == [f"nats://{p}:{client_port['cluster']}" for p in pods]
    env = rendered[("ConfigMap", next(n for k, n in rendered if k == "ConfigMap" and n.startswith("switchyard-env")))]
    assert env["data"]["NATS_URL"].split(",") == [f"nats://{p}:{client_port['client']}" for p in pods]
    assert 1 < int(env["data"]["SY_NATS_REPLICAS"]) <= replicas


def test_the_gateways_probes_are_its_real_routes(rendered):
    paths = {route.path for route in router.routes}
    (api,) = rendered[("Deployment", "api")]["spec"]["template"]["spec"]["containers"]
    _, args = _parse(api["command"])
    assert rendered[("Deployment", "api")]["spec"]["replicas"] >= 2  # either gateway answers
    ready, live = api["readinessProbe"], api["livenessProbe"]
    assert ready["httpGet"]["path"] == "/ready" and live["httpGet"]["path"] == "/live" and {"/ready", "/live"} <= paths
    assert ready["httpGet"]["port"] == live["httpGet"]["port"] == args.port == api["ports"][0]["containerPort"]
    assert ready["timeoutSeconds"] > args.ready_timeout_s  # a probe that generates needs the time it may take
    assert rendered[("Service", "api")]["spec"]["ports"][0]["targetPort"] == args.port


def test_schedulers_lead_by_lease_and_workers_ask_for_their_accelerator(rendered):
    scheduler = rendered[("Deployment", "scheduler")]
    _, args = _parse(scheduler["spec"]["template"]["spec"]["containers"][0]["command"])
    assert scheduler["spec"]["replicas"] >= 2 and args.leader_lease  # a leader and a standby
    resources = {"cuda": "nvidia.com/gpu", "qaic": "qualcomm.com/qaic"}
    for accel in ("cpu", "cuda", "qaic"):
        spec = rendered[("Deployment", f"worker-{accel}")]["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        _, args = _parse(container["command"])
        assert args.device == accel and spec["nodeSelector"] == {"switchyard.io/accelerator": accel}
        if accel in resources:
            assert container["resources"]["limits"][resources[accel]] == 1
        if accel == "qaic":
            convert(json.loads(_env(rendered, container)["SY_QAIC_CONFIG"]), QaicConfig, "SY_QAIC_CONFIG").validate()


def test_keda_scales_the_workers_on_a_metric_the_gateway_exports(rendered):
    scaled = rendered[("ScaledObject", "worker-cpu")]
    assert ("Deployment", scaled["spec"]["scaleTargetRef"]["name"]) in rendered
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert "vllm:num_requests_waiting" in trigger["metadata"]["query"]
    assert "vllm:num_requests_waiting" in {name for _, name, _, _ in _ENGINE_SERIES}
    model = _env(rendered, rendered[("Deployment", "api")]["spec"]["template"]["spec"]["containers"][0])["SY_MODEL"]
    assert f'model_name="{model}"' in trigger["metadata"]["query"]


@pytest.fixture(scope="module")
def monitored(tmp_path_factory) -> dict[tuple[str, str], dict]:
    """The base with the optional monitoring component, as an overlay of a user's would add it."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (`make test` installs Debian's kubernetes-client)")
    root = tmp_path_factory.mktemp("k8s-monitored")
    shutil.copytree(BASE.parent, root / "k8s")
    subprocess.run([sys.executable, "-m", "shared.bus.nats_auth", str(root / "k8s" / "base" / "auth")], check=True,
                   capture_output=True)
    overlay = root / "k8s" / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text("resources: [../base]\ncomponents: [../components/monitoring]\n")
    out = subprocess.run([kubectl, "kustomize", str(overlay)], check=True, capture_output=True, text=True).stdout
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(out) if doc}


def test_prometheus_scrapes_the_gateways_metrics_route(rendered, monitored):
    """KEDA's query needs a Prometheus that scrapes the gateways: by annotation, or by the PodMonitor."""
    pod = rendered[("Deployment", "api")]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
    assert int(notes["prometheus.io/port"]) in {p["containerPort"] for p in container["ports"]}
    assert "/metrics" in {route.path for route in router.routes}
    monitor = monitored[("PodMonitor", "api")]
    labels = monitored[("Deployment", "api")]["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] in {p["name"] for p in container["ports"]}


def test_the_dashboard_reads_only_metrics_the_gateway_exports(monitored, stack, openai_client, model_name):
    """Every series the Grafana dashboard queries is on a real gateway's /metrics (once it served)."""
    import re
    import urllib.request

    openai_client.completions.create(model=model_name, prompt="Hi", max_tokens=3)

    board = monitored[("ConfigMap", "switchyard-dashboard")]
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(board["data"]["switchyard.json"])
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queried = {m for e in exprs for m in re.findall(r"\b((?:vllm:|switchyard_)[a-z0-9_:]+)", e)}
    with urllib.request.urlopen(stack.base_url + "/metrics", timeout=30) as resp:
        exported = {line.split("{")[0].split(" ")[0] for line in resp.read().decode().splitlines()
                    if line and not line.startswith("#")}
    assert len(queried) >= 10
    assert queried <= exported, queried - exported
