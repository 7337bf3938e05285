"""`make run`: nats-server (unless NATS_URL is given; --nats-cluster 3: a cluster of three), then
kvcache, workers, the worker agent (which starts the workers of deployed pipelines), scheduler and API.

Waits until the API is ready (/ready: a token flows), restarts a service that dies or, for the API,
stops answering /live, and on Ctrl-C stops them all.
Unknown flags (e.g. --max-num-seqs 32) go to every service.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shared.bus import nats_auth
from shared.gateway_config import add_api_args
from shared.models.model_files import cache_root
from switchyard import model_fetch
from switchyard.nats_server import NatsCluster, NatsServer
from switchyard.service_flags import check_service_args, engine_defaults_lines

RESTART_BACKOFF_S = 2.0
LIVE_EVERY_S = 5.0  # the API's /live is asked this often...
LIVE_FAILURES = 3  # ...and a gateway that fails it this many times in a row is restarted
BUS_FILE = "bus.json"  # beside the JetStream store: {"url", "auth_file"} of the running stack's bus


@dataclass
class Service:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    num_restarts: int = 0
    log_file: Path | None = None

    def start(self, env: dict) -> None:
        out = open(self.log_file, "ab") if self.log_file else None
        self.proc = subprocess.Popen(self.argv, env=env, stdout=out, stderr=subprocess.STDOUT if out else None)

    @property
    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Stack:
    nats_url: str | None = None
    api_port: int = 8000
    num_workers: int = 1
    # disaggregated prefill: workers that compute prompts and workers that decode (--kv-transfer-config)
    num_prefill_workers: int = 0
    num_decode_workers: int = 0
    num_schedulers: int = 1  # more than one: they share a leader lease, the others standbys
    num_gateways: int = 1  # API processes of their own, each with its bus client, on api_port, api_port + 1, ...
    service_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    nats: NatsServer | NatsCluster | None = None
    nats_cluster: int = 1  # nats-servers it starts when it has no NATS_URL (more than one: a cluster)
    nats_replicas: int = 1  # SY_NATS_REPLICAS for every service: copies of each JetStream store
    auth_dir: str | None = None  # the locked bus's users (shared/bus/nats_auth.py); None: an open bus
    bus_file: Path | None = None  # written while the stack runs on a bus of its own
    store_lock: object | None = field(default=None, repr=False)  # held while it runs on its store
    services: list[Service] = field(default_factory=list)
    is_stopping: bool = False
    live_failures: dict[str, int] = field(default_factory=dict)  # per gateway, failed /live in a row
    live_asked_at: float = 0.0
    model_fetched: bool | None = None  # None: not looked yet; True: a Hub id, in the cache, read offline
    fetched_path: str | None = None  # the Hub id's local file or folder

    def fetch_model(self) -> None:
        """A Hub id in --model-path is downloaded here, once (model_fetch.py); FetchFailed says why not."""
        if self.model_fetched is not None:
            return
        hub = model_fetch.hub_model(self.service_args)
        if hub is not None:
            self.fetched_path = model_fetch.fetch(*hub, env=self._env(None))
            print(f"[launcher] model: {hub[0]} -> {self.fetched_path}", flush=True)
        self.model_fetched = hub is not None

    def start(self) -> Stack:
        self.fetch_model()
        if self.nats_url is None:  # its JetStream store (the model registry) outlives the stack
            store = Path(os.environ.get("SY_NATS_STORE_DIR", cache_root() / "nats"))
            store.mkdir(parents=True, exist_ok=True)
            self.store_lock = lock_store(store)
            if self.nats_cluster > 1:  # each node its own store; the stores kept on 3 of them (or all)
                self.nats = NatsCluster(self.nats_cluster, store_dir=str(store / "cluster"), auth=True,
                                        log_dir=str(self.log_dir) if self.log_dir else None).start()
                self.nats_replicas = min(3, self.nats_cluster)
            else:
                self.nats = NatsServer(store_dir=str(store), auth=True).start()
            self.nats_url, self.auth_dir = self.nats.url, self.nats.auth_dir
            self.bus_file = store.parent / BUS_FILE  # where a script finds this bus (shared/bus/connection.py)
            self.bus_file.write_text(json.dumps({"url": self.nats_url, "auth_file": str(
                Path(self.auth_dir) / nats_auth.USERS_FILE)}))
        py = [sys.executable, "-m"]
        common = ["--nats-url", self.nats_url, *self.service_args]
        self.services = [Service("kvcache", py + ["services.kvcache", "--nats-url", self.nats_url])]
        self.services += [self.worker(f"worker-{i}") for i in range(self.num_workers)]
        for role, count in (("prefill", self.num_prefill_workers), ("decode", self.num_decode_workers)):
            config = json.dumps({"kv_connector": "SharedMemoryConnector",
                                 "kv_role": "kv_producer" if role == "prefill" else "kv_consumer"})
            self.services += [self.worker(f"worker-{role}-{i}", "--kv-transfer-config", config) for i in range(count)]
        agent_log_dir = ["--agent-log-dir", str(self.log_dir / "agent-workers")] if self.log_dir else []
        self.services.append(Service("agent", py + ["services.agent", *common, *agent_log_dir]))
        lease = ["--leader-lease", "scheduler"] if self.num_schedulers > 1 else []
        for i in range(self.num_schedulers):
            name = "scheduler" if i == 0 else f"scheduler-{i}"
            self.services.append(Service(name, py + ["services.scheduler", *common, *lease]))
        for i in range(self.num_gateways):
            self.services.append(Service(gateway_name(i), py + ["services.api", *common, "--port", str(self.api_port + i)]))
        for svc in self.services:
            if self.log_dir:
                svc.log_file = self.log_dir / f"{svc.name}.log"
            svc.start(self._env(svc.name))
        return self

    def worker(self, name: str, *extra: str) -> Service:
        """A worker on this stack's bus and flags; `extra` after them (of a flag given twice, the last counts)."""
        return Service(name, [sys.executable, "-m", "services.worker", "--nats-url", self.nats_url, *self.service_args,
                              *extra, "--worker-id", name])

    def add_worker(self, name: str, *extra: str, wrapper: Sequence[str] = ()) -> Service:
        """One more worker started beside the running stack (another host's, in tests and bench/disagg.py);
        wrapper: a command it runs under (`ip netns exec b`: a host's network of its own)."""
        service = self.worker(name, *extra)
        service.argv = [*wrapper, *service.argv]
        service.log_file = self.log_dir / f"{name}.log" if self.log_dir else None
        self.services.append(service)
        service.start(self._env(name))
        return service

    def _env(self, service: str | None) -> dict:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        if self.model_fetched:  # every service loads the snapshot the launcher fetched
            env["HF_HUB_OFFLINE"] = "1"
        if self.auth_dir is not None and service is not None:
            env |= nats_auth.env_for(nats_auth.user_of(service), self.auth_dir)
        if self.nats_replicas > 1:
            env["SY_NATS_REPLICAS"] = str(self.nats_replicas)
        return env

    @property
    def admin_url(self) -> str:
        """The bus as an operator (or a test) reaches it: with the admin login when it is locked."""
        return nats_auth.url_with_login(self.nats_url, "admin", self.auth_dir) if self.auth_dir else self.nats_url

    @property
    def base_url(self) -> str:
        return self.gateway_url(0)

    def gateway_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.api_port + i}"

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.is_stopping:
            for svc in self.services:
                if svc.proc is not None and svc.proc.poll() is not None:
                    raise RuntimeError(f"{svc.name} exited with {svc.proc.returncode} while starting")
            if all(self._answers("/ready", timeout=15, url=self.gateway_url(i)) for i in range(self.num_gateways)):
                return  # a one-token generation went through every model, from every gateway
            time.sleep(0.25)
        if self.is_stopping:
            return
        raise TimeoutError(f"the stack was not ready after {timeout}s")

    def _answers(self, path: str, timeout: float, url: str | None = None) -> bool:
        try:
            with urllib.request.urlopen((url or self.base_url) + path, timeout=timeout) as resp:
                return resp.status == 200
        except OSError:
            return False

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def supervise_once(self) -> None:
        """Restart any service that died (with a pause, so a crash loop does not spin), a gateway
        that fails /live LIVE_FAILURES times in a row (its loop is stuck: alive is not enough), and
        a node of its own NATS cluster that died (it rejoins on its store, as a StatefulSet's pod does)."""
        if time.monotonic() - self.live_asked_at > LIVE_EVERY_S:
            self.live_asked_at = time.monotonic()
            for i in range(self.num_gateways):
                self._check_live(self.service(gateway_name(i)), self.gateway_url(i))
        for node in self.nats.nodes if isinstance(self.nats, NatsCluster) else []:
            if not self.is_stopping and node.proc is not None and node.proc.poll() is not None:
                print(f"[launcher] nats node {node.cluster.name} exited with {node.proc.returncode}; restarting",
                      flush=True)
                node.start()
        for svc in self.services:
            if self.is_stopping:
                return
            if svc.proc is not None and svc.proc.poll() is not None:
                print(f"[launcher] {svc.name} exited with {svc.proc.returncode}; restarting", flush=True)
                time.sleep(RESTART_BACKOFF_S)
                svc.num_restarts += 1
                svc.start(self._env(svc.name))

    def _check_live(self, api: Service, url: str) -> None:
        if not api.is_running:
            return
        failures = 0 if self._answers("/live", timeout=LIVE_EVERY_S, url=url) else self.live_failures.get(api.name, 0) + 1
        self.live_failures[api.name] = failures
        if failures >= LIVE_FAILURES:
            print(f"[launcher] {api.name} failed /live {LIVE_FAILURES} times in a row; restarting it", flush=True)
            self.live_failures[api.name] = 0
            api.proc.kill()
            api.proc.wait()

    def stop(self, grace_s: float = 45.0, signal_children: bool = True) -> None:
        """SIGTERM every service (each drains its in-flight work), then wait; kill what outlives grace_s.

        signal_children=False when the children already got the signal (Ctrl-C reaches the whole
        process group): a second signal would make them stop at once instead of draining.
        """
        self.is_stopping = True
        for svc in reversed(self.services):
            if svc.is_running and signal_children:
                svc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for svc in self.services:
            if svc.proc is None:
                continue
            try:
                svc.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                svc.proc.kill()
                svc.proc.wait()
        if self.nats is not None:
            self.nats.stop()
        if self.bus_file is not None:
            self.bus_file.unlink(missing_ok=True)
        if self.store_lock is not None:
            self.store_lock.close()


def gateway_name(i: int) -> str:
    """The launcher's gateways: `api`, then `api-1`, `api-2`, ... (each its own process and port)."""
    return "api" if i == 0 else f"api-{i}"


class StoreInUse(RuntimeError):
    pass


def lock_store(store: Path):
    """One stack per JetStream store: two nats-servers on one store corrupt its registry. The lock
    is held (by an open file) until this process exits, however it exits."""
    handle = open(store / "switchyard.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "another process"
        handle.close()
        raise StoreInUse(f"another `make run` ({owner}) uses the registry store {store}: stop it first, or give "
                         "this one a store of its own with SY_NATS_STORE_DIR=/some/other/folder") from None
    handle.truncate(0)
    handle.write(f"pid {os.getpid()}")
    handle.flush()
    return handle


def served_devices(stack: Stack, service_args: list[str]) -> list[str]:
    """Each model's workers' device lines as /v1/models lists them (what computes, e.g. whether a
    --compile is on its way), or nothing where they cannot be read."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_api_args(parser)
    key = parser.parse_known_args(service_args)[0].api_key
    request = urllib.request.Request(stack.base_url + "/v1/models",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            models = json.load(resp)["data"]
    except (OSError, ValueError, KeyError):
        return []
    return [f"{m['id']}: {', '.join(m.get('devices') or ['no worker yet'])}" for m in models]


def main(argv: list[str] | None = None, after_ready=None) -> None:
    """after_ready(stack, service_args), once the stack is healthy (`switchyard serve` deploys there)."""
    parser = argparse.ArgumentParser(allow_abbrev=False, description="Run the whole Switchyard stack")
    parser.add_argument("--port", type=int, default=int(os.environ.get("SY_PORT", "8000")))
    parser.add_argument("--workers", type=int, default=int(os.environ.get("SY_WORKERS", "1")))
    parser.add_argument("--prefill-workers", type=int, default=int(os.environ.get("SY_PREFILL_WORKERS", "0")),
                        help="disaggregated prefill: workers that compute prompts and hand each request to a "
                             "--decode-workers worker at its first token, through the host KV tier (needs "
                             "--kv-offloading-size; docs/kv_offloading.md); instead of --workers")
    parser.add_argument("--decode-workers", type=int, default=int(os.environ.get("SY_DECODE_WORKERS", "0")),
                        help="disaggregated prefill: workers that decode what the prefill workers hand on")
    parser.add_argument("--schedulers", type=int, default=int(os.environ.get("SY_SCHEDULERS", "1")),
                        help="scheduler processes: past one, they lead by turns (--leader-lease), the others "
                             "standbys that take over the queue when the leader is gone (default 1)")
    parser.add_argument("--gateways", type=int, default=int(os.environ.get("SY_GATEWAYS", "1")),
                        help="API gateway processes, each with its own bus client, on --port, --port + 1, ... "
                             "(default 1; --api-processes shares one port among a gateway's processes instead)")
    parser.add_argument("--nats-cluster", type=int, default=int(os.environ.get("SY_NATS_CLUSTER", "1")),
                        help="nats-servers to start (without NATS_URL): 3 makes a routed cluster with JetStream "
                             "clustered and every store kept at replication 3 (default 1: one server)")
    args, service_args = parser.parse_known_args(argv)
    if args.nats_cluster < 1 or args.schedulers < 1 or args.gateways < 1:
        parser.error("--nats-cluster, --schedulers and --gateways must be at least 1")
    check_service_args(service_args)
    if args.prefill_workers or args.decode_workers:
        if args.prefill_workers < 1 or args.decode_workers < 1:
            parser.error("--prefill-workers and --decode-workers go together, each at least 1")
        if "--kv-offloading-size" not in service_args and not os.environ.get("SY_KV_OFFLOADING_SIZE"):
            parser.error("--prefill-workers / --decode-workers hand requests on through the host KV tier: "
                         "give it --kv-offloading-size GIB")
        args.workers = 0
    users = os.environ.get("SY_NATS_AUTH_FILE")  # an outside bus locked with shared/bus/nats_auth.py's users
    stack = Stack(nats_url=os.environ.get("NATS_URL"), api_port=args.port, num_workers=args.workers,
                  num_prefill_workers=args.prefill_workers, num_decode_workers=args.decode_workers,
                  service_args=service_args, auth_dir=os.path.dirname(users) if users else None,
                  nats_cluster=args.nats_cluster, num_schedulers=args.schedulers, num_gateways=args.gateways,
                  nats_replicas=int(os.environ.get("SY_NATS_REPLICAS", "1")))
    received: list[int] = []

    def on_signal(signum, _frame):
        received.append(signum)
        stack.is_stopping = True  # do not restart children that are on their way out

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    own = "(own)" if args.nats_cluster == 1 else f"(own cluster of {args.nats_cluster}, stores at replication "\
        f"{min(3, args.nats_cluster)})"
    print(f"[launcher] starting: nats {'at ' + stack.nats_url if stack.nats_url else own}, "
          f"{args.workers} worker(s), API on {', '.join(stack.gateway_url(i) for i in range(args.gateways))}",
          flush=True)
    try:
        stack.fetch_model()
    except model_fetch.FetchFailed as exc:
        sys.exit(f"[launcher] {exc}")
    for line in engine_defaults_lines(service_args, stack.fetched_path):
        print(f"[launcher] engine: {line}", flush=True)
    try:
        stack.start()
    except StoreInUse as exc:
        sys.exit(f"[launcher] {exc}")
    try:
        stack.wait_ready()
        print(f"[launcher] ready: {stack.base_url}/v1 (Ctrl-C stops everything)", flush=True)
        for line in served_devices(stack, service_args):
            print(f"[launcher] serving {line}", flush=True)
        if stack.bus_file is not None:
            print(f"[launcher] bus: {stack.nats_url}, locked; a script connects with "
                  f"shared.bus.connect_running() ({stack.bus_file})", flush=True)
        if after_ready is not None:
            after_ready(stack, service_args)
        while not stack.is_stopping:
            stack.supervise_once()
            time.sleep(0.5)
    finally:
        print("[launcher] stopping (in-flight requests drain first)", flush=True)
        # a terminal's Ctrl-C (SIGINT) reached every child already; a SIGTERM reached only us
        stack.stop(signal_children=signal.SIGINT not in received)


if __name__ == "__main__":
    main()
