"""--api-processes: several gateway processes on one port, against the session stack's scheduler.

Each process has its own connections and reply subject; /metrics on any of them reports the sum;
a child that dies is replaced; SIGTERM drains them all and leaves nothing behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from switchyard.nats_server import free_port
from tests.test_launcher import children_of

pytestmark = pytest.mark.stack
NUM_REQUESTS = 8


def wait_healthy(base_url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(base_url + "/health", timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{base_url} was not healthy after {timeout}s")


def listening(pids: list[int], port: int) -> set[int]:
    """Which of pids hold a socket listening on port (from /proc: the kernel's own word)."""
    inodes = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
            inodes.add(f"socket:[{fields[9]}]")
    return {pid for pid in pids if inodes & _open_files(pid)}


def _open_files(pid: int) -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed since the listing
            pass
    return found


def wait_listening(pids: list[int], port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and listening(pids, port) != set(pids):
        time.sleep(0.2)
    assert listening(pids, port) == set(pids)


def num_successes(base_url: str) -> float:
    """One scrape on a new connection (so on whichever process the kernel picks)."""
    text = urllib.request.urlopen(base_url + "/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))


def complete(base_url: str, model_name: str) -> str:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:  # a client of its own: a new connection, which the kernel may give to either process
        return client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=2,
                                         temperature=0).choices[0].text
    finally:
        client.close()


@pytest.fixture()
def gateway(stack, tmp_path):
    port = free_port()
    env = stack._env("api")  # a gateway's login on the locked bus
    log = open(tmp_path / "api.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.api", "--nats-url", stack.nats_url, "--port", str(port),
                             "--api-processes", "2", *stack.service_args], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url)
        yield proc, base_url, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        print((tmp_path / "api.log").read_text()[-3000:])


def test_processes_share_the_port_and_sum_their_metrics(gateway, model_name):
    proc, base_url, port = gateway
    children = children_of(proc.pid)
    assert len(children) == 2
    wait_listening(children, port)  # both on the one port, each with its own socket
    texts = [complete(base_url, model_name) for _ in range(NUM_REQUESTS)]
    assert len(set(texts)) == 1  # greedy: the same answer from either process
    # each scrape lands on either process; each must see every request (8 scrapes: both, but for 2^-7)
    assert [num_successes(base_url) for _ in range(8)] == [NUM_REQUESTS] * 8

    os.kill(children[0], signal.SIGKILL)  # a child that dies is replaced; what it counted stays
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(set(children_of(proc.pid)) - {children[0]}) < 2:
        time.sleep(0.2)
    replaced = children_of(proc.pid)
    assert len(replaced) == 2 and children[0] not in replaced
    wait_listening(replaced, port)  # the new child serves the port too
    complete(base_url, model_name)
    assert num_successes(base_url) == NUM_REQUESTS + 1


def test_sigterm_stops_every_process_and_cleans_up(gateway):
    proc, _, _ = gateway
    children = children_of(proc.pid)
    metrics_dirs = [line.split("=", 1)[1] for line in
                    open(f"/proc/{children[0]}/environ", "rb").read().decode().split("\0")
                    if line.startswith("PROMETHEUS_MULTIPROC_DIR=")]
    assert len(metrics_dirs) == 1 and os.path.isdir(metrics_dirs[0])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not any(os.path.exists(f"/proc/{pid}") for pid in children)
    assert not os.path.exists(metrics_dirs[0])
