"""Start a private nats-server (JetStream on) on a free port, or a cluster of them: for `make run` and tests."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from shared.bus import nats_auth


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 10.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")


@dataclass
class ClusterRole:
    """One node's place in a cluster: its name, where routes reach it, and the other nodes' routes."""

    name: str
    port: int
    routes: list[str]
    cluster_name: str = "switchyard"


class NatsServer:
    def __init__(self, port: int | None = None, store_dir: str | None = None, auth: bool = False,
                 host: str = "127.0.0.1", auth_dir: str | None = None, cluster: ClusterRole | None = None,
                 wrapper: list[str] | None = None, log_file: str | None = None, max_payload: int | None = None):
        """store_dir: where JetStream keeps the registry; a temporary folder (removed at stop) if None.
        auth: one user per service with only its subjects (shared/bus/nats_auth.py); the passwords are
        made once, at the first start, so a restart keeps them (auth_dir: a cluster's shared ones).
        host: the address it listens on. cluster: a node of a routed cluster (JetStream clustered).
        wrapper: a command it runs under (`ip netns exec h1`: a test's host). max_payload: the largest
        message it takes, if not nats-server's 1 MB."""
        self.host = host
        self.port = port or free_port()
        self.is_temporary = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="switchyard-nats-")
        self.owns_auth = auth and auth_dir is None
        self.auth_dir = auth_dir or (tempfile.mkdtemp(prefix="switchyard-nats-auth-") if auth else None)
        self.cluster = cluster
        self.wrapper = wrapper or []
        self.log_file = log_file
        self.max_payload = max_payload
        self.monitor_port = free_port()  # its HTTP monitoring (/connz, /jsz, /healthz), on the same address
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def connections(self) -> list[str]:
        """The names of the clients connected to it now (its /connz)."""
        with urllib.request.urlopen(f"http://{self.host}:{self.monitor_port}/connz?limit=1024", timeout=5) as resp:
            return [c.get("name", "") for c in json.load(resp).get("connections") or []]

    def start(self) -> NatsServer:
        binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
        config = ["-c", str(conf)] if (conf := self._config_file()) else []
        if self.cluster is not None:
            c = self.cluster
            config += ["--server_name", c.name, "--cluster_name", c.cluster_name,
                       "--cluster", f"nats://{self.host}:{c.port}", "--routes", ",".join(c.routes)]
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        self.proc = subprocess.Popen([*self.wrapper, binary, *config, "-a", self.host, "-p", str(self.port), "-js",
                                      "-m", str(self.monitor_port),
                                      "-sd", self.store_dir],
                                     stdout=out, stderr=subprocess.STDOUT if self.log_file else subprocess.DEVNULL,
                                     start_new_session=True)  # Ctrl-C stops services first, us last
        wait_for_port(self.port, host=self.host)
        return self

    def _config_file(self) -> Path | None:
        """The auth file, under one that also sets max_payload where asked (nats-server takes one -c,
        and an include's path relative to the including file's folder)."""
        auth = None
        if self.auth_dir is not None:
            conf = Path(self.auth_dir) / nats_auth.CONF_FILE
            auth = conf if conf.exists() else nats_auth.write(self.auth_dir)
        if self.max_payload is None:
            return auth
        limits = Path(self.auth_dir or self.store_dir) / f"limits-{self.port}.conf"
        limits.write_text((f'include "{auth.name}"\n' if auth else "") + f"max_payload: {self.max_payload}\n")
        return limits

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.is_temporary:
            shutil.rmtree(self.store_dir, ignore_errors=True)
        if self.owns_auth:
            shutil.rmtree(self.auth_dir, ignore_errors=True)


class NatsCluster:
    """`size` nats-servers routed into one cluster with JetStream clustered (each node its own store):
    a store kept at SY_NATS_REPLICAS=3 outlives any one node. Services take `url`, every node's."""

    def __init__(self, size: int = 3, store_dir: str | None = None, auth: bool = False,
                 hosts: list[str] | None = None, wrappers: list[list[str]] | None = None,
                 log_dir: str | None = None):
        """hosts: each node's address (default 127.0.0.1); wrappers: each node's command prefix (a
        test's network namespace). store_dir: the nodes' stores go in its n0, n1, ... (temporary if None)."""
        if size < 1:
            raise ValueError(f"a cluster needs at least one node, got {size}")
        hosts = hosts or ["127.0.0.1"] * size
        ports = [free_port() for _ in range(size)]
        self.auth_dir = tempfile.mkdtemp(prefix="switchyard-nats-auth-") if auth else None
        routes = [f"nats://{h}:{p}" for h, p in zip(hosts, ports, strict=True)]
        self.nodes = [NatsServer(store_dir=str(Path(store_dir) / f"n{i}") if store_dir else None, auth=auth,
                                 host=hosts[i], auth_dir=self.auth_dir,
                                 cluster=ClusterRole(f"n{i}", ports[i], [r for j, r in enumerate(routes) if j != i]),
                                 wrapper=(wrappers or [[]] * size)[i],
                                 log_file=str(Path(log_dir) / f"nats-n{i}.log") if log_dir else None)
                      for i in range(size)]

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    def start(self, timeout: float = 30.0) -> NatsCluster:
        for node in self.nodes:
            Path(node.store_dir).mkdir(parents=True, exist_ok=True)
            node.start()
        self.wait_for_jetstream(timeout)
        return self

    def wait_for_jetstream(self, timeout: float = 30.0) -> None:
        """Until the nodes have elected JetStream's meta leader (a store can be made)."""
        import asyncio

        import nats

        from shared.bus import servers

        url = nats_auth.url_with_login(self.url, "admin", self.auth_dir) if self.auth_dir else self.url

        async def ready() -> None:
            nc = await nats.connect(servers(url), max_reconnect_attempts=-1, reconnect_time_wait=0.1)
            try:
                deadline = time.monotonic() + timeout
                while True:
                    try:
                        await nc.jetstream().account_info()
                        return
                    except Exception:
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"JetStream was not clustered after {timeout}s") from None
                        await asyncio.sleep(0.2)
            finally:
                await nc.close()

        asyncio.run(ready())

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        if self.auth_dir is not None:
            shutil.rmtree(self.auth_dir, ignore_errors=True)
