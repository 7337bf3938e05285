"""The stack laid out across test hosts (tests/hosts.py), for the fault tests and bench/hosts_faults.py.

  host a: nats-0, api, kvcache   host b: nats-1, api   host c: nats-2
  host d, e: scheduler (one leads by lease, one stands by)   host f, g: a worker each

Each host's services are supervised as the launcher or systemd would: one that exits (a deposed
leader, lease.DEPOSED_EXIT) starts again, unless its host was killed (`kill_host`).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import urllib.request
from pathlib import Path

import nats

from services.scheduler.lease import LEASES_BUCKET
from shared.bus import nats_auth, servers
from switchyard.nats_server import NatsCluster
from tests.bus_helpers import scheduler_stats
from tests.hosts import Hosts

API_PORT = 8000
ARGS = ["--kv-cache-memory-gib", "0.4", "--threads", "1", "--no-deterministic"]  # the defaults, small


class Cluster:
    """The hosts, the bus on three of them, and each service on its own."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.hosts = Hosts(list("abcdefg")).make()
        nodes = [self.hosts[h] for h in "abc"]
        self.nats = NatsCluster(3, auth=True, hosts=[h.address for h in nodes], wrappers=[h.wrapper for h in nodes],
                                log_dir=str(log_dir))
        self.services: dict[str, tuple[str, list[str]]] = {}  # name -> (host, argv)
        self.procs: dict[str, object] = {}
        self.down: set[str] = set()  # killed hosts: nothing restarts there until `run`
        self.restarts: list[tuple[str, int]] = []  # (service, the exit status it was restarted after)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, daemon=True)

    def start(self) -> Cluster:
        self.nats.start(timeout=60)
        for node, host in zip(self.nats.nodes, "abc", strict=True):
            self.hosts[host].adopt(node.proc)
        py = [sys.executable, "-m"]
        common = ["--nats-url", self.nats.url, *ARGS]
        self.services = {
            "kvcache": ("a", py + ["services.kvcache", "--nats-url", self.nats.url]),
            "worker-f": ("f", py + ["services.worker", *common, "--worker-id", "worker-f"]),
            "worker-g": ("g", py + ["services.worker", *common, "--worker-id", "worker-g"]),
            "scheduler-d": ("d", py + ["services.scheduler", *common, "--leader-lease", "scheduler"]),
            "scheduler-e": ("e", py + ["services.scheduler", *common, "--leader-lease", "scheduler"]),
            "api-a": ("a", py + ["services.api", *common, "--host", "0.0.0.0", "--port", str(API_PORT)]),
            "api-b": ("b", py + ["services.api", *common, "--host", "0.0.0.0", "--port", str(API_PORT)]),
        }
        for name in self.services:
            self.run(name)
        self._supervisor.start()
        for api in ("api-a", "api-b"):
            self.wait_ready(api)
        return self

    def run(self, name: str) -> None:
        """Start (or start again) a service on its host, which is then up."""
        host, argv = self.services[name]
        env = dict(os.environ) | nats_auth.env_for(nats_auth.user_of(name.rsplit("-", 1)[0]), self.nats.auth_dir)
        env |= {"SY_NATS_REPLICAS": "3", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        with self._lock:
            self.down.discard(host)
            self.procs[name] = self.hosts[host].run(argv, env, self.log_dir / f"{name}.log")

    def kill_host(self, host: str) -> None:
        """Every process on the host, -9, its supervisor with them."""
        with self._lock:
            self.down.add(host)
            self.hosts[host].kill()

    def _supervise(self) -> None:
        while not self._stopping.wait(0.5):
            for name, (host, _) in self.services.items():
                with self._lock:
                    status = self.procs[name].poll()
                    if status is None or host in self.down:
                        continue
                self.restarts.append((name, status))
                with open(self.log_dir / f"{name}.log", "a") as log:
                    log.write(f"[supervisor] {name} exited with {status}; restarting\n")
                self.run(name)

    def base_url(self, api: str) -> str:
        return f"http://{self.hosts[self.services[api][0]].address}:{API_PORT}"

    def wait_ready(self, api: str, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.procs[api].poll() is None, f"{api} exited"
            try:
                with urllib.request.urlopen(self.base_url(api) + "/ready", timeout=15) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{api} was not ready after {timeout}s")

    async def until_workers(self, model: str, count: int, timeout: float = 120.0) -> None:
        """Until the model's scheduler counts `count` workers (one cut off rejoins on its own)."""
        nc = await nats.connect(self.admin_url, max_reconnect_attempts=-1)
        try:
            async with asyncio.timeout(timeout):
                while (await scheduler_stats(nc, model)).num_workers != count:
                    await asyncio.sleep(0.2)
        finally:
            await nc.close()

    async def leader(self) -> str:
        """The scheduler whose process holds the lease now (its holder is host-pid)."""
        nc = await nats.connect(self.admin_url, max_reconnect_attempts=-1)
        try:
            holder = (await (await nc.jetstream().key_value(LEASES_BUCKET)).get("scheduler.scheduler")).value
        finally:
            await nc.close()
        pid = int(holder.rsplit(b"-", 1)[1])
        return next(name for name in ("scheduler-d", "scheduler-e") if self.procs[name].pid == pid)

    @property
    def admin_url(self) -> list[str]:
        return servers(nats_auth.url_with_login(self.nats.url, "admin", self.nats.auth_dir))

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor.is_alive():
            self._supervisor.join()
        self.hosts.remove()
        self.nats.stop()
