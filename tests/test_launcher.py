"""`make run`'s launcher: starts everything on its own nats-server, and Ctrl-C stops every process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from switchyard.nats_server import free_port

pytestmark = pytest.mark.stack


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_ctrl_c_stops_every_process(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    env["PYTHONPATH"] = os.getcwd()
    env["SY_NATS_STORE_DIR"] = str(tmp_path / "nats")  # its nats-server keeps the registry there
    log = open(tmp_path / "launcher.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "switchyard.launcher", "--port", str(port),
                             "--kv-cache-memory-gib", "0.4", "--threads", "1"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise AssertionError((tmp_path / "launcher.log").read_text()[-3000:])
        started = children_of(proc.pid)
        assert len(started) == 6  # nats-server, kvcache, worker, agent, scheduler, api
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        assert proc.wait(30) == 0
        for pid in started:
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_model_yields_the_cores_to_the_serving_path(stack):
    """The worker runs at niceness 10 by default, so the gateway, scheduler and nats-server preempt
    the model's threads when they share cores; they themselves keep the default."""
    def niceness(name: str) -> int:
        return os.getpriority(os.PRIO_PROCESS, stack.service(name).proc.pid)

    assert niceness("worker-0") - niceness("api") == 10
    assert niceness("scheduler") == niceness("api")
