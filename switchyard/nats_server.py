"""Start a private nats-server (JetStream on) on a free port: for `make run` and for tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from shared import nats_auth


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


class NatsServer:
    def __init__(self, port: int | None = None, store_dir: str | None = None, auth: bool = False):
        """store_dir: where JetStream keeps the registry; a temporary folder (removed at stop) if None.
        auth: one user per service with only its subjects (shared/nats_auth.py); the passwords are
        made once, at the first start, so a restart keeps them."""
        self.port = port or free_port()
        self.is_temporary = store_dir is None
        self.store_dir = store_dir or tempfile.mkdtemp(prefix="switchyard-nats-")
        self.auth_dir = tempfile.mkdtemp(prefix="switchyard-nats-auth-") if auth else None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsServer:
        binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
        config = []
        if self.auth_dir is not None:
            conf = Path(self.auth_dir) / nats_auth.CONF_FILE
            config = ["-c", str(conf if conf.exists() else nats_auth.write(self.auth_dir))]
        self.proc = subprocess.Popen([binary, *config, "-a", "127.0.0.1", "-p", str(self.port), "-js",
                                      "-sd", self.store_dir],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)  # Ctrl-C stops services first, us last
        wait_for_port(self.port)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.is_temporary:
            shutil.rmtree(self.store_dir, ignore_errors=True)
        if self.auth_dir is not None:
            shutil.rmtree(self.auth_dir, ignore_errors=True)
