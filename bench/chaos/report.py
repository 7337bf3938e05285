"""What a chaos run promised, checked: every accepted request ended, every exact one as its lone run,
errors only where a fault may cause them (docs/architecture.md), nothing left held or leaked after."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from bench.chaos.faults import Fault
from bench.chaos.run import ChaosResult

FD_SLACK = 64  # sockets come and go (reconnects): more than this many new handles is a leak
RSS_SLACK = 1.25  # a worker's resident memory may grow this much over the run (its allocator's warm-up)
GATEWAY_LOSS_S = 30.0  # a gateway killed this long before a request's start may still refuse it (restarting)


@dataclass
class Verdict:
    requests: int
    by_status: Counter
    lost: list[str]  # accepted, then ended with an error no fault explains
    hung: int
    differed: list[str]
    pauses: dict[str, float]  # per fault kind, the longest gap in any stream's tokens after it
    leaks: list[str]  # processes, file handles, memory, requests or KV blocks left over

    @property
    def ok(self) -> bool:
        return not (self.lost or self.hung or self.differed or self.leaks)


def verdict(result: ChaosResult) -> Verdict:
    statuses = Counter(o.status for o in result.outcomes)
    lost = [f"{o.spec} via gateway {o.gateway}: {o.detail}" for o in result.outcomes
            if o.status == "error" or (o.status == "gateway_lost" and not _gateway_killed(result.faults, o))]
    differed = [f"{o.spec}: {o.detail}" for o in result.outcomes if o.status == "differed"]
    return Verdict(len(result.outcomes), statuses, lost, statuses["hung"], differed, _pauses(result), _leaks(result))


def _gateway_killed(faults: list[Fault], outcome) -> bool:
    name = "api" if outcome.gateway == 0 else f"api-{outcome.gateway}"
    return any(f.kind == "gateway_kill" and f.target == name and outcome.started - GATEWAY_LOSS_S <= f.at <= outcome.ended
               for f in faults)


def _pauses(result: ChaosResult) -> dict[str, float]:
    """For each fault, the longest wait for a streamed token after it, over the streams in flight."""
    out: dict[str, float] = {}
    for fault in result.faults:
        for o in result.outcomes:
            times = [t for t in o.chunk_times if t > fault.at]
            if not times or o.started > fault.at or o.status not in ("whole", "ended"):
                continue
            gaps = [b - a for a, b in zip([fault.at, *times], times, strict=False)]
            out[fault.kind] = max(out.get(fault.kind, 0.0), max(gaps))
    return out


def _leaks(result: ChaosResult) -> list[str]:
    leaks = []
    if result.num_running_after or result.num_waiting_after:
        leaks.append(f"{result.num_running_after} requests running and {result.num_waiting_after} waiting after the load")
    if result.kv_usage_after:
        leaks.append(f"KV usage {result.kv_usage_after:.3f} after the load (every block should be free)")
    if result.lost_tasks:
        leaks.append(f"a task failed unseen (\"never retrieved\") in {result.lost_tasks}")
    if result.leftover_pids:
        leaks.append(f"processes left after the stack stopped: {result.leftover_pids}")
    for name, before in result.census_before.items():
        after = result.census_after.get(name)
        if after is None or after.pid != before.pid:
            continue  # restarted by a fault: a new process
        if after.num_fds > before.num_fds + FD_SLACK:
            leaks.append(f"{name}: {before.num_fds} -> {after.num_fds} open file handles")
        if name.startswith("worker") and after.rss_bytes > before.rss_bytes * RSS_SLACK:
            leaks.append(f"{name}: resident memory {before.rss_bytes >> 20} -> {after.rss_bytes >> 20} MiB")
    return leaks


def table(result: ChaosResult, v: Verdict) -> str:
    kinds = Counter(f.kind for f in result.faults)
    lines = ["| fault | times | longest pause in a stream after it (s) |", "|---|---|---|"]
    lines += [f"| {kind} | {n} | {v.pauses.get(kind, 0.0):.1f} |" for kind, n in sorted(kinds.items())]
    lines += ["", f"requests {v.requests}: " + ", ".join(f"{k} {n}" for k, n in sorted(v.by_status.items())),
              f"lost {len(v.lost)}, hung {v.hung}, differed {len(v.differed)}, leaks {len(v.leaks)}",
              f"largest logprob difference from a lone run: {max((o.logprob_gap for o in result.outcomes), default=0):.2g}"]
    lines += [f"  lost: {x}" for x in v.lost[:10]] + [f"  differed: {x}" for x in v.differed[:10]]
    lines += [f"  leak: {x}" for x in v.leaks]
    return "\n".join(lines)
