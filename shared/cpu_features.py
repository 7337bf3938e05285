"""The CPU's instruction sets as /proc/cpuinfo lists them (standard library only: the Makefile runs it)."""

from __future__ import annotations

from pathlib import Path


def cpu_flags(cpuinfo: str) -> set[str]:
    """The `flags` line of /proc/cpuinfo as a set."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def host_cpu_flags() -> set[str]:
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return set()
