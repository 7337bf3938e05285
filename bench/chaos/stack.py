"""The stack as a platform runs it, under the launcher's own supervision: a NATS cluster of three,
a scheduler and its standby, two workers, two gateways, LoRA adapters; and what it holds (processes,
file handles, memory, requests, KV blocks) read from the outside."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats

from bench.chaos.load import MODEL
from bench.memory import private_rss_bytes
from services.scheduler.lease import LEASES_BUCKET
from shared.wire import subjects
from shared.wire.messages import WORKER_ANNOUNCE_DECODER, encode
from shared.wire.stats import SCHEDULER_STATS_DECODER, SchedulerStats, SchedulerStatsRequest
from switchyard.launcher import Stack, gateway_name
from switchyard.nats_server import free_port


@dataclass
class ProcessCensus:
    """One service process as seen from /proc: its pid, open file handles and resident memory (less
    the KV pool's shared memory: bench/memory.py)."""

    name: str
    pid: int
    num_fds: int
    rss_bytes: int


@dataclass
class ChaosStack:
    log_dir: Path
    service_args: list[str]
    num_workers: int = 2
    stack: Stack | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # a fault's signal vs the supervisor's restart
    squeeze_answers: list[tuple[int, int]] = field(default_factory=list)
    _started: list[int] = field(default_factory=list)  # its processes when it was stopped
    kept_file: str = ""  # a file a test uploaded before the faults (the Files store must keep it)
    _supervisor: threading.Thread | None = None
    _stopping: threading.Event = field(default_factory=threading.Event)

    def start(self) -> ChaosStack:
        self.stack = Stack(api_port=free_port_pair(), num_workers=self.num_workers, num_schedulers=2,
                           num_gateways=2, nats_cluster=3, log_dir=self.log_dir, service_args=self.service_args)
        saved = os.environ.get("SY_NATS_STORE_DIR")
        os.environ["SY_NATS_STORE_DIR"] = str(self.log_dir / "nats-store")  # the launcher's store, not make run's
        try:
            self.stack.start()
        finally:
            if saved is None:
                del os.environ["SY_NATS_STORE_DIR"]
            else:
                os.environ["SY_NATS_STORE_DIR"] = saved
        try:
            self.stack.wait_ready(timeout=600)
            asyncio.run(self.wait_workers(self.num_workers))
        except Exception:
            self.stop()
            raise
        self._supervisor = threading.Thread(target=self._supervise, daemon=True)
        self._supervisor.start()
        return self

    def _supervise(self) -> None:
        """What `make run`'s launcher does in its main loop: restart what died."""
        while not self._stopping.is_set():
            with self.lock:
                self.stack.supervise_once()
            self._stopping.wait(0.5)

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
        if self.stack is not None:
            self._started = self._processes()
            self.stack.stop()

    def leftovers(self) -> list[int]:
        """The stack's processes (its services, NATS nodes and what they started) alive after stop."""
        return [pid for pid in self._started if _alive(pid)]

    def lost_tasks(self) -> list[str]:
        """Services' logs that say a task failed unseen ("Task exception was never retrieved"): a
        request or a loop dropped on the floor, often at shutdown."""
        return [p.name for p in sorted(self.log_dir.glob("*.log")) if "never retrieved" in p.read_text(errors="replace")]

    def _processes(self) -> list[int]:
        roots = [s.proc.pid for s in self.stack.services if s.proc is not None] + [
            n.proc.pid for n in self.stack.nats.nodes if n.proc is not None]
        return [pid for root in roots for pid in [root, *descendants(root)]]

    @property
    def worker_names(self) -> list[str]:
        return [f"worker-{i}" for i in range(self.num_workers)]

    @property
    def gateway_names(self) -> list[str]:
        return [gateway_name(i) for i in range(self.stack.num_gateways)]

    def signal(self, name: str, sig: signal.Signals) -> None:
        with self.lock:
            proc = self.stack.service(name).proc
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, sig)

    async def _bus(self):
        return await nats.connect(self.stack.admin_url.split(","), max_reconnect_attempts=3, connect_timeout=5)

    async def stats(self) -> SchedulerStats:
        nc = await self._bus()
        try:
            msg = await nc.request(subjects.scheduler_stats(MODEL), encode(SchedulerStatsRequest()), timeout=5)
            return SCHEDULER_STATS_DECODER.decode(msg.data)
        finally:
            await nc.close()

    async def wait_workers(self, num: int, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if (await self.stats()).num_workers >= num:
                    return
            except Exception:  # noqa: BLE001 - no leader yet
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{num} workers never joined")
            await asyncio.sleep(0.5)

    async def busiest_worker(self, rng: random.Random) -> str:
        """The worker with the most running sequences, as its heartbeats would say; any if none runs."""
        counts = {}
        nc = await self._bus()
        try:
            sub = await nc.subscribe(subjects.WORKERS_HEARTBEAT)
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline and len(counts) < self.num_workers:
                try:
                    msg = await sub.next_msg(timeout=max(deadline - time.monotonic(), 0.01))
                except Exception:  # noqa: BLE001 - nats' timeout
                    break
                beat = WORKER_ANNOUNCE_DECODER.decode(msg.data)
                counts[beat.worker_id] = getattr(beat, "num_running", 0)
        finally:
            await nc.close()
        if not counts or max(counts.values()) == 0:
            return rng.choice(self.worker_names)
        return max(counts, key=counts.get)

    async def leader(self) -> str:
        """The launched scheduler whose process holds the lease (its holder is host-pid)."""
        nc = await self._bus()
        try:
            entry = await (await nc.jetstream().key_value(LEASES_BUCKET)).get("scheduler.scheduler")
        finally:
            await nc.close()
        pid = int(entry.value.decode().rsplit("-", 1)[1])
        return next(s.name for s in self.stack.services if s.name.startswith("scheduler") and s.proc.pid == pid)

    def census(self) -> dict[str, ProcessCensus]:
        """Every service process and NATS node now: pid, file handles, resident memory (less the KV pool)."""
        procs = [(s.name, s.proc) for s in self.stack.services] + [
            (f"nats-{n.cluster.name}", n.proc) for n in self.stack.nats.nodes]
        out = {}
        for name, proc in procs:
            if proc is None or proc.poll() is not None:
                continue
            try:
                num_fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
                rss = private_rss_bytes(proc.pid)
            except OSError:
                continue
            out[name] = ProcessCensus(name, proc.pid, num_fds, rss)
        return out


def descendants(root: int) -> list[int]:
    """Every process below `root` now."""
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def free_port_pair() -> int:
    """A port whose next one is free too (the second gateway's)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
