"""`python -m bench.chaos --minutes N`: the stack as a platform runs it, under a steady mixed load,
with a random fault every 15-40 s (bench/chaos/faults.py); the report checks every request.

    python -m bench.chaos --minutes 30 [--seed 1] [--fixed] [--concurrency 10] [--log-dir DIR]
        [--service-args '--speculative-config {"method": "ngram", "num_speculative_tokens": 4}']

Exits non-zero when a promise was broken (a request lost, hung or with other tokens; a leak).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from bench.chaos.report import table, verdict
from bench.chaos.run import run_chaos
from bench.cpu_flags import cpu_name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fixed", action="store_true", help="CI's schedule: every fault kind once in 2.4 minutes (FIXED_MINUTES)")
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--service-args", default="", help="more flags for every service (shell-quoted)")
    args = parser.parse_args()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="switchyard-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"[chaos] {args.minutes:g} minutes, seed {args.seed}, on {cpu_name()}; logs in {log_dir}", flush=True)
    result = run_chaos(log_dir, args.minutes, seed=args.seed, fixed=args.fixed, concurrency=args.concurrency,
                       extra_args=shlex.split(args.service_args))
    v = verdict(result)
    (log_dir / "outcomes.json").write_text(json.dumps({"faults": [asdict(f) for f in result.faults],
                                                       "outcomes": [asdict(o) for o in result.outcomes]}))
    print(table(result, v), flush=True)
    sys.exit(0 if v.ok else 1)


if __name__ == "__main__":
    main()
