"""A process's memory as /proc tells it (status, and smaps for one mapping), and the leak checks' measure:
resident outside the KV pool."""

from __future__ import annotations

from pathlib import Path


def status_mib(pid: int | str = "self", field: str = "VmRSS") -> float:
    """One of /proc's memory fields in MiB (VmRSS resident, VmSize mapped, RssShmem resident shared
    memory); 0 where the kernel does not list it. OSError when the process is gone."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def private_rss_bytes(pid: int | str = "self") -> int:
    """VmRSS less RssShmem: the KV pool lies in shared memory (services/worker/backends/kv_pool.py) and
    becomes resident as its blocks are first used, which is no leak. OSError when the process is gone."""
    return round((status_mib(pid) - status_mib(pid, "RssShmem")) * 2**20)


def mapping_kib(address: int, pid: int | str = "self") -> dict[str, int] | None:
    """/proc/PID/smaps' sizes in KiB (Rss, AnonHugePages ...) for the mapping that holds `address`;
    None if none does."""
    found = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if not fields[0].endswith(":"):  # a mapping's first line: its address range, then its sizes
            if found is not None:
                return found
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found = {} if start <= address < end else None
        elif found is not None and fields[-1] == "kB":
            found[fields[0][:-1]] = int(fields[1])
    return found
