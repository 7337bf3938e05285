"""The worker processes of one deployment on one host: start, watch, stop, and scale within bounds.

Scaling follows the deployment's scheduler: a queue that stays deep (requests waiting for
`scale_up_after_s`) adds a replica up to replicas_max; an idle engine (nothing running or waiting
for `scale_down_after_s`) removes one down to replicas_min. A replica that exits on its own is
marked failed (with the last line it logged) and started again after RESTART_BACKOFF_S.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shared.control.deployment import DeployedModel
from shared.control.registry import WorkerState
from shared.wire.stats import SchedulerStats

RESTART_BACKOFF_S = 5.0


@dataclass
class Replica:
    worker_id: str
    proc: subprocess.Popen
    log_path: Path
    state: str = "starting"  # starting | running | stopping | failed
    error: str | None = None
    exited_at: float = 0.0

    def last_line(self) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1][-500:] if lines else ""


@dataclass
class Replicas:
    deployed: DeployedModel
    nats_url: str
    log_dir: Path
    worker_args: list[str]
    scale_up_after_s: float = 5.0
    scale_down_after_s: float = 30.0
    replicas: list[Replica] = field(default_factory=list)
    busy_since: float | None = None  # requests have been waiting since
    idle_since: float | None = None  # nothing running or waiting since
    clock: Callable[[], float] = time.monotonic  # tests pass one they move by hand

    @property
    def generation(self) -> int:
        return self.deployed.pipeline.generation

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.state in ("starting", "running")]

    @property
    def occupied(self) -> list[Replica]:
        """Slots taken: live replicas, and failed ones until their restart backoff has passed."""
        return [r for r in self.replicas if r.state != "stopping"]

    def start_one(self) -> Replica:
        pipeline = self.deployed.pipeline
        worker_id = f"{pipeline.deployment}-g{pipeline.generation}-{uuid.uuid4().hex[:6]}"
        log_path = self.log_dir / f"{worker_id}.log"
        argv = [sys.executable, "-m", "services.worker", "--nats-url", self.nats_url, "--worker-id", worker_id,
                "--pipeline", pipeline.name, "--generation", str(pipeline.generation), *self.worker_args]
        with open(log_path, "ab") as out:  # its own session: only the agent signals it, and drains it
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=_worker_env())
        replica = Replica(worker_id, proc, log_path)
        self.replicas.append(replica)
        return replica

    def stop_one(self) -> None:
        """The newest live replica drains and exits (SIGTERM)."""
        if self.live:
            replica = self.live[-1]
            replica.state = "stopping"
            replica.proc.send_signal(signal.SIGTERM)

    def stop_all(self) -> None:
        """SIGTERM each replica once: a second signal would cut its drain short."""
        for replica in self.replicas:
            if replica.proc.poll() is None and replica.state != "stopping":
                replica.state = "stopping"
                replica.proc.send_signal(signal.SIGTERM)

    def reap(self) -> None:
        """Forget replicas that were stopped and exited; mark the ones that died as failed."""
        now = self.clock()
        for replica in list(self.replicas):
            code = replica.proc.poll()
            if code is None:
                continue
            if replica.state == "stopping":
                self.replicas.remove(replica)
            elif replica.state != "failed":
                replica.state, replica.exited_at = "failed", now
                replica.error = f"exited with {code}: {replica.last_line()}"
            elif now - replica.exited_at > RESTART_BACKOFF_S:
                self.replicas.remove(replica)  # make room: the next tick starts a fresh one

    def wanted(self, stats: SchedulerStats | None) -> int:
        """How many replicas there should be now, within replicas_min..replicas_max."""
        config = self.deployed.deployment_config
        now, n = self.clock(), len(self.live)
        if stats is not None:
            self.busy_since = (self.busy_since or now) if stats.num_waiting > 0 else None
            idle = stats.num_running == 0 and stats.num_waiting == 0
            self.idle_since = (self.idle_since or now) if idle else None
        if self.busy_since is not None and now - self.busy_since > self.scale_up_after_s:
            self.busy_since = None
            n += 1
        elif self.idle_since is not None and now - self.idle_since > self.scale_down_after_s:
            self.idle_since = None
            n -= 1
        return min(max(n, config.replicas_min), config.replicas_max)

    def states(self) -> list[WorkerState]:
        return [WorkerState(worker_id=r.worker_id, deployment=self.deployed.name, generation=self.generation,
                            pid=r.proc.pid, state=r.state, error=r.error) for r in self.replicas]


def _worker_env() -> dict[str, str]:
    """The agent's environment, but a replica connects to a locked bus as a worker, not as the agent."""
    env = dict(os.environ)
    if env.get("SY_NATS_USER"):
        env["SY_NATS_USER"] = "worker"
    return env
