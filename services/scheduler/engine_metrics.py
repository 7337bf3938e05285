"""The histograms a pool observes as its steps come back, counted as vLLM's engine counts them."""

from __future__ import annotations

from collections import Counter

from services.scheduler.request import Request
from shared.wire.histogram import HistogramCounts
from shared.wire.messages import (
    ITERATION_TOKEN_BUCKETS,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    SpecDecodeCounts,
    StepResult,
)


class EngineMetrics:
    def __init__(self) -> None:
        self.iteration_tokens = HistogramCounts.empty(ITERATION_TOKEN_BUCKETS)
        self.request_num_preemptions = HistogramCounts.empty(REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.spec_decode = SpecDecodeCounts()

    def observe_step(self, rows: list[Request], result: StepResult, num_steps: int = 1) -> None:
        """vLLM's iteration_tokens_total: per iteration, each token sampled plus the whole prompt of a
        request in the iteration of its first token (a prefill chunk that samples nothing adds 0);
        a multi-step Step's later iterations, one token per row still running (a row that speculated
        keeps its tokens in one iteration). And the spec_decode counters. Called before the result
        is applied (a row's output is still what it was). Probes are left out."""
        rows_by_id = {r.request_id: r for r in rows if not r.is_probe}
        if not rows_by_id:
            return
        self.spec_decode.observe([d for d in result.drafts if d.request_id in rows_by_id])
        per_row = Counter(s.request_id for s in result.sampled if s.request_id in rows_by_id)
        first = sum((1 if num_steps > 1 else n) + (0 if rows_by_id[rid].output_token_ids else
                                                   rows_by_id[rid].num_prompt_tokens)
                    for rid, n in per_row.items())
        self.iteration_tokens.observe(first)
        for i in range(1, max(per_row.values(), default=1) if num_steps > 1 else 1):
            self.iteration_tokens.observe(sum(1 for n in per_row.values() if n > i))

    def observe_finished(self, request: Request) -> None:
        """vLLM's request_num_preemptions: once per request that finished on a worker."""
        if not request.is_probe:
            self.request_num_preemptions.observe(request.num_preemptions)
