"""Static batching, for comparison only (bench/): a batch forms while none of it has decoded, then
runs to completion before anything else is admitted."""

from __future__ import annotations

from services.scheduler.scheduler import Scheduler


class StaticScheduler(Scheduler):
    def _is_batch_open(self) -> bool:
        return not any(r.output_token_ids for r in self.running)
