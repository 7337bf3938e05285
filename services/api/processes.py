"""`--api-processes N`: N gateway processes on one port (SO_REUSEPORT), each with its own bus
client, under one supervisor, so that admission is not capped by one Python process."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from shared.log import get_logger

log = get_logger("api")
RESTART_BACKOFF_S = 1.0
_PR_SET_PDEATHSIG = 1


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A socket bound with SO_REUSEPORT: every gateway process binds its own on the same port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _die_with_parent() -> None:
    """Runs in the child before exec: the kernel kills it when the supervisor goes, however."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Supervisor:
    """- Each child binds the port with SO_REUSEPORT, and the kernel spreads new connections over them.
    - Each has its own bus client, so its own reply subject (DESIGN.md: each API process subscribes
      to its own sy.v1.out.<api_id>).
    - Each writes its Prometheus series to one folder shared by all (prometheus_client's
      multiprocess mode); /metrics on any of them reports the sum.
    The supervisor forwards SIGTERM (each child drains its own requests), restarts a child that
    dies, and removes the folder when the last child has exited. The children die with it, even on
    SIGKILL (PR_SET_PDEATHSIG). Measured in docs/benchmarks.md (ninth VM: admission)."""

    def __init__(self, argv: list[str], num_processes: int):
        """argv: the gateway's own flags; each child gets them with --api-processes 1 --reuse-port."""
        self.child_argv = [sys.executable, "-m", "services.api", *argv, "--api-processes", "1", "--reuse-port"]
        self.num_processes = num_processes
        self.metrics_dir = tempfile.mkdtemp(prefix="switchyard-api-metrics-")
        self.children: list[subprocess.Popen] = []
        self.is_stopping = False

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            self.children = [self._spawn() for _ in range(self.num_processes)]
            log.info("api_processes_started", pids=[c.pid for c in self.children])
            while not self.is_stopping:
                self._restart_exited()
                time.sleep(0.25)
            for child in self.children:
                child.wait()
        finally:
            for child in self.children:
                if child.poll() is None:
                    child.kill()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        return 0

    def _spawn(self) -> subprocess.Popen:
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=self.metrics_dir)
        return subprocess.Popen(self.child_argv, env=env, preexec_fn=_die_with_parent)

    def _restart_exited(self) -> None:
        from prometheus_client import multiprocess

        for i, child in enumerate(self.children):
            if child.poll() is None or self.is_stopping:
                continue
            log.warning("api_process_exited", pid=child.pid, returncode=child.returncode)
            multiprocess.mark_process_dead(child.pid, self.metrics_dir)  # its in-flight gauge; counters stay
            time.sleep(RESTART_BACKOFF_S)
            self.children[i] = self._spawn()

    def _on_signal(self, signum, _frame) -> None:
        """SIGTERM is forwarded: the first makes each child drain, a second stops them at once. A
        terminal's Ctrl-C (SIGINT) reached every child already, through the process group."""
        self.is_stopping = True
        if signum == signal.SIGTERM:
            for child in self.children:
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
