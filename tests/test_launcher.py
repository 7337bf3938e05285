"""`make run`'s launcher: starts everything on its own nats-server, and Ctrl-C stops every process."""

from __future__ import annotations

import asyncio
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


async def submit_as_a_script(bus_file) -> str:
    """The README's bus snippet: make run's locked bus, found through its bus file, as a "client"."""
    from shared.bus import connect_running
    from shared.bus.client import BusClient
    from shared.wire.messages import SamplingParams

    nc = await connect_running(bus_file=bus_file)
    bus = BusClient(nc)
    await bus.start()
    stream = await bus.submit("SmolLM2-135M-Instruct", [504, 3575, 282], SamplingParams(max_tokens=4, temperature=0))
    entries = [e async for e in stream.entries(timeout=60)]
    await bus.stop()
    await nc.close()
    return entries[-1].finish_reason.name


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
        deadline = time.monotonic() + 240  # the launcher prints its bus line once every service is ready
        while "shared.bus.connect_running()" not in (tmp_path / "launcher.log").read_text():
            assert time.monotonic() < deadline and proc.poll() is None, \
                (tmp_path / "launcher.log").read_text()[-3000:]
            time.sleep(0.5)
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).status == 200
        # what computes, once ready (the defaults: float32 on the C kernels)
        assert "[launcher] serving SmolLM2-135M-Instruct: cpu (float32, gguf weights, C kernels (" in \
            (tmp_path / "launcher.log").read_text()
        started = children_of(proc.pid)
        assert len(started) == 6  # nats-server, kvcache, worker, agent, scheduler, api
        assert asyncio.run(submit_as_a_script(tmp_path / "bus.json")) == "LENGTH"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        assert proc.wait(30) == 0
        for pid in started:
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_model_keeps_its_fair_share_of_the_cores(stack):
    """The worker runs at the services' niceness by default: a niced model is starved by any busy
    neighbour on a shared host (docs/benchmarks.md, 2026-11-28)."""
    def niceness(name: str) -> int:
        return os.getpriority(os.PRIO_PROCESS, stack.service(name).proc.pid)

    assert niceness("worker-0") == niceness("api") == niceness("scheduler")


def test_a_second_stack_on_the_same_store_is_refused_by_name(tmp_path):
    from switchyard.launcher import StoreInUse, lock_store

    first = lock_store(tmp_path)
    with pytest.raises(StoreInUse, match=f"pid {os.getpid()}.*SY_NATS_STORE_DIR"):
        lock_store(tmp_path)
    first.close()  # the first stack stopped: the store is free again
    lock_store(tmp_path).close()


def test_log_exception_keeps_the_traceback_in_the_json_line():
    script = ("from shared import log\nlog.configure('t')\n"
              "try:\n    1 / 0\nexcept ZeroDivisionError:\n    log.get_logger('x').exception('boom')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=dict(
        os.environ, PYTHONPATH=os.getcwd()), check=True).stderr
    import json

    line = json.loads(out.strip().splitlines()[-1])
    assert line["event"] == "boom" and "ZeroDivisionError" in line["exception"] and "Traceback" in line["exception"]
