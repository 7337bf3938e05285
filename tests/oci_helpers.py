"""A real OCI registry for tests: Debian's docker-registry (the CNCF distribution server) on a free port."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from switchyard.nats_server import free_port


class OciRegistry:
    def __init__(self, folder: Path):
        binary = shutil.which("docker-registry") or "/usr/bin/docker-registry"
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        config = folder / "config.yml"
        config.write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {folder}/data\n"
                          f"  delete:\n    enabled: true\nhttp:\n  addr: {self.host}\n")
        self.log = open(folder / "registry.log", "wb")
        self.proc = subprocess.Popen([binary, "serve", str(config)], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"docker-registry did not start: {(folder / 'registry.log').read_text()}") \
                        from None
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()
