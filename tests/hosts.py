"""Test hosts on one machine: a network namespace each, joined by veth pairs on a private bridge.

Each host has its own network stack (its own 127.0.0.1 and ports), an address on the bridge, and
runs processes under `ip netns exec`. A host can be cut off (its link down: TCP connections stall,
as a partition does, rather than reset) and healed, or killed (every process on it, -9).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def can_make_hosts() -> str | None:
    """Why namespaces cannot be made here, or None (they need root and iproute2)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"sy-probe-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"ip netns add failed: {exc}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Host:
    name: str
    netns: str
    address: str
    link: str  # the bridge's end of its veth pair
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def wrapper(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]

    def run(self, argv: list[str], env: dict, log: Path) -> subprocess.Popen:
        proc = subprocess.Popen([*self.wrapper, *argv], env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def adopt(self, proc: subprocess.Popen) -> None:
        """A process started on this host another way (a NatsServer under its wrapper)."""
        self.procs.append(proc)

    def cut(self) -> None:
        _ip("link", "set", self.link, "down")

    def heal(self) -> None:
        _ip("link", "set", self.link, "up")

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()


class Hosts:
    """hosts = Hosts(["a", "b"]).make(); hosts["a"].run(...); hosts.remove() at the end."""

    def __init__(self, names: list[str]):
        self.tag = secrets.token_hex(2)
        self.subnet = f"10.{200 + int(self.tag[:2], 16) % 50}.{int(self.tag[2:], 16)}"
        self.bridge = f"sybr{self.tag}"
        self.hosts = {name: Host(name, f"sy{self.tag}-{name}", f"{self.subnet}.{10 + i}", f"syv{self.tag}{i}")
                      for i, name in enumerate(names)}

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def make(self) -> Hosts:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, host in enumerate(self.hosts.values()):
            inside = f"syp{self.tag}{i}"
            _ip("netns", "add", host.netns)
            _ip("link", "add", host.link, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", host.netns)
            _ip("link", "set", host.link, "master", self.bridge, "up")
            _ip("netns", "exec", host.netns, "ip", "addr", "add", f"{host.address}/24", "dev", inside)
            _ip("netns", "exec", host.netns, "ip", "link", "set", inside, "up")
            _ip("netns", "exec", host.netns, "ip", "link", "set", "lo", "up")
        return self

    def remove(self) -> None:
        for host in self.hosts.values():
            host.kill()
            subprocess.run(["ip", "link", "del", host.link], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
