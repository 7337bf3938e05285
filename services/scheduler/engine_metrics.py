"""The histograms a pool observes as its steps come back, counted as vLLM's engine counts them."""

from __future__ import annotations

from collections import Counter

from services.scheduler.request import Request
from shared.wire.histogram import HistogramCounts
from shared.wire.messages import StepResult
from shared.wire.spec_decode import SpecDecodeCounts
from shared.wire.stats import ITERATION_TOKEN_BUCKETS, REQUEST_NUM_PREEMPTIONS_BUCKETS


class EngineMetrics:
    def __init__(self) -> None:
        self.iteration_tokens = HistogramCounts.empty(ITERATION_TOKEN_BUCKETS)
        self.request_num_preemptions = HistogramCounts.empty(REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.spec_decode = SpecDecodeCounts()

    def observe_step(self, rows: list[Request], result: StepResult) -> None:
        """vLLM's iteration_tokens_total: per iteration, each token sampled (a row that speculated may
        keep several) plus the whole prompt of a request in the iteration of its first token (a
        prefill chunk that samples nothing adds 0); a multi-step Step's iterations each. And the
        spec_decode counters. Called before the result is applied (a row's output is still what it
        was). Probes are left out."""
        rows_by_id = {r.request_id: r for r in rows if not r.is_probe}
        if not rows_by_id:
            return
        self.spec_decode.observe([d for d in result.drafts if d.request_id in rows_by_id])
        start = 0
        for i, size in enumerate(result.iteration_sizes or [len(result.sampled)]):
            per_row = Counter(s.request_id for s in result.sampled[start : start + size] if s.request_id in rows_by_id)
            start += size
            if i == 0:
                self.iteration_tokens.observe(sum(n + (0 if rows_by_id[rid].output_token_ids else
                                                       rows_by_id[rid].num_prompt_tokens)
                                                  for rid, n in per_row.items()))
            elif per_row:
                self.iteration_tokens.observe(sum(per_row.values()))

    def add(self, other: EngineMetrics) -> None:
        """Another pool's counts into these (a pool that is gone: the model's counters never go back)."""
        self.iteration_tokens = HistogramCounts.total([self.iteration_tokens, other.iteration_tokens],
                                                      ITERATION_TOKEN_BUCKETS)
        self.request_num_preemptions = HistogramCounts.total(
            [self.request_num_preemptions, other.request_num_preemptions], REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.spec_decode.add(other.spec_decode)

    def observe_finished(self, request: Request) -> None:
        """vLLM's request_num_preemptions: once per request that finished on a worker."""
        if not request.is_probe:
            self.request_num_preemptions.observe(request.num_preemptions)
