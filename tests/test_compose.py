"""compose.yaml names nats, the four services (each `python -m services.<name>`) and the agent."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import yaml

from shared.bus import nats_auth
from shared.control.deploy_config import QaicConfig, convert


def test_compose_runs_every_service_module():
    compose = yaml.safe_load((Path(__file__).parent.parent / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"nats-auth", "nats-1", "nats-2", "nats-3", "kvcache", "worker", "worker-gpu",
                             "worker-qaic", "agent", "scheduler", "api"}
    qaic = services["worker-qaic"]  # only under `--profile qaic`: the same model on the QAIC emulator
    assert qaic["profiles"] == ["qaic"] and qaic["command"][-2:] == ["--device", "qaic"]
    convert(json.loads(qaic["environment"]["SY_QAIC_CONFIG"]), QaicConfig, "SY_QAIC_CONFIG").validate()
    gpu = services["worker-gpu"]  # only under `--profile gpu`, on an NVIDIA device
    assert gpu["profiles"] == ["gpu"] and gpu["command"][-2:] == ["--device", "cuda"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert services["agent"]["command"][:3] == ["python", "-m", "services.agent"]
    assert importlib.util.find_spec("services.agent") is not None
    nodes = [f"nats-{i}" for i in (1, 2, 3)]
    for node in nodes:  # a cluster of three, each routed to the other two, each its own store
        command = services[node]["command"]
        assert "-js" in command and command[command.index("--server_name") + 1] == node
        routes = command[command.index("--routes") + 1].split(",")
        assert sorted(routes) == [f"nats://{other}:6222" for other in nodes if other != node]
        assert services[node]["volumes"][0] == f"nats-data-{node[-1]}:/data"
    assert "/ready" in services["api"]["healthcheck"]["test"][-1]  # readiness that generates
    for name in ("kvcache", "worker", "scheduler", "api"):
        command = services[name]["command"]
        assert command[:3] == ["python", "-m", f"services.{name}"]
        assert importlib.util.find_spec(f"services.{name}.__main__") is not None
        assert services[name]["environment"]["NATS_URL"].split(",") == [f"nats://{n}:4222" for n in nodes]
        assert services[name]["environment"]["SY_NATS_REPLICAS"] == "3"
        assert services[name]["environment"]["SY_NATS_USER"] == nats_auth.user_of(name)  # its own login
        assert services[name]["environment"]["SY_NATS_AUTH_FILE"] == "/auth/nats-users.json"


def test_compose_binds_to_localhost_drains_and_builds_small():
    root = Path(__file__).parent.parent
    services = yaml.safe_load((root / "compose.yaml").read_text())["services"]
    for name in ("api", "nats-1"):  # published ports: 127.0.0.1 unless SY_BIND says otherwise
        assert all(port.startswith("${SY_BIND:-127.0.0.1}:") for port in services[name]["ports"]), name
    for node in ("nats-1", "nats-2", "nats-3"):
        assert services[node]["command"][:2] == ["-c", "/auth/nats-auth.conf"]
        assert services[node]["depends_on"]["nats-auth"]["condition"] == "service_completed_successfully"
    assert services["nats-auth"]["command"] == ["python", "-m", "shared.bus.nats_auth", "/auth"]
    grace = {name: int(services[name]["stop_grace_period"].rstrip("s")) for name in ("worker", "agent", "api")}
    assert grace["worker"] >= 45 and grace["agent"] >= 45 and grace["api"] >= 35  # past drain_grace_s (30 s)
    assert ".venv" in (root / ".dockerignore").read_text().split()
    dockerfile = (root / "Dockerfile").read_text()
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in dockerfile
    assert "FROM ${PYTHON_IMAGE}" in dockerfile


def test_nats_auth_keeps_what_compose_already_made(tmp_path):
    import subprocess
    import sys

    first = subprocess.run([sys.executable, "-m", "shared.bus.nats_auth", str(tmp_path)], capture_output=True, check=True)
    users = (tmp_path / nats_auth.USERS_FILE).read_text()
    subprocess.run([sys.executable, "-m", "shared.bus.nats_auth", str(tmp_path)], capture_output=True, check=True)
    assert (tmp_path / nats_auth.USERS_FILE).read_text() == users and first.stdout
    assert oct((tmp_path / nats_auth.USERS_FILE).stat().st_mode)[-3:] == "600"
    assert set(json.loads(users)) == set(nats_auth.PERMISSIONS)
