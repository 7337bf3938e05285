"""compose.yaml names nats, the four services (each `python -m services.<name>`) and the agent."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import yaml

from shared.deploy_config import QaicConfig, convert


def test_compose_runs_every_service_module():
    compose = yaml.safe_load((Path(__file__).parent.parent / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"nats", "kvcache", "worker", "worker-gpu", "worker-qaic", "agent", "scheduler", "api"}
    qaic = services["worker-qaic"]  # only under `--profile qaic`: the same model on the QAIC emulator
    assert qaic["profiles"] == ["qaic"] and qaic["command"][-2:] == ["--device", "qaic"]
    convert(json.loads(qaic["environment"]["SY_QAIC_CONFIG"]), QaicConfig, "SY_QAIC_CONFIG").validate()
    gpu = services["worker-gpu"]  # only under `--profile gpu`, on an NVIDIA device
    assert gpu["profiles"] == ["gpu"] and gpu["command"][-2:] == ["--device", "cuda"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert services["agent"]["command"][:3] == ["python", "-m", "services.worker.agent"]
    assert importlib.util.find_spec("services.worker.agent") is not None
    assert "-js" in services["nats"]["command"]
    for name in ("kvcache", "worker", "scheduler", "api"):
        command = services[name]["command"]
        assert command[:3] == ["python", "-m", f"services.{name}"]
        assert importlib.util.find_spec(f"services.{name}.__main__") is not None
        assert services[name]["environment"]["NATS_URL"] == "nats://nats:4222"
