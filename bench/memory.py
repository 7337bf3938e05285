"""A process's resident memory outside the host KV pool, read from /proc (the leak checks' measure)."""

from __future__ import annotations

from pathlib import Path


def private_rss_bytes(pid: int | str = "self") -> int:
    """VmRSS less RssShmem: the KV pool lies in shared memory (services/worker/backends/kv_pool.py) and
    becomes resident as its blocks are first used, which is no leak. OSError when the process is gone."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return (int(status["VmRSS"].split()[0]) - int(status.get("RssShmem", "0 kB").split()[0])) * 1024
