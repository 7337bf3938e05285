"""The histograms a pool keeps, counted as vLLM's engine counts them (vLLM's test_metrics_counts)."""

from __future__ import annotations

from services.scheduler.engine_metrics import EngineMetrics
from services.scheduler.request import Request
from shared.wire.messages import Sampled, SamplingParams, StepResult
from shared.wire.spec_decode import Drafts


def _request(request_id: str, num_prompt: int, num_output: int = 0, is_probe: bool = False) -> Request:
    return Request(request_id, list(range(num_prompt)), SamplingParams(max_tokens=20), "reply",
                   output_token_ids=list(range(num_output)), is_probe=is_probe)


def _result(*request_ids: str) -> StepResult:
    return StepResult(step_id=1, sampled=[Sampled(request_id=r, token_id=5) for r in request_ids])


def test_a_prompt_counts_whole_in_the_iteration_of_its_first_token():
    metrics = EngineMetrics()
    new, running, chunk = _request("new", 9), _request("running", 4, num_output=3), _request("chunk", 50)
    metrics.observe_step([new, running, chunk], _result("new", "running"))  # chunk: a prefill chunk, no token yet
    assert (metrics.iteration_tokens.sum, metrics.iteration_tokens.count) == (9 + 1 + 1, 1)


def test_a_multi_step_steps_later_iterations_count_a_token_per_row_still_running():
    metrics = EngineMetrics()
    a, b = _request("a", 4, num_output=1), _request("b", 4, num_output=1)
    result = _result("a", "b", "a", "b", "a")  # b finished after two iterations
    result.iteration_sizes = [2, 2, 1]
    metrics.observe_step([a, b], result)
    assert metrics.iteration_tokens.count == 3 and metrics.iteration_tokens.sum == 2 + 2 + 1
    assert metrics.iteration_tokens.counts[:2] == [1, 3]  # le=1: one iteration; le=8: all three


def test_a_row_that_speculated_keeps_its_tokens_in_one_iteration_and_its_drafts_are_counted():
    metrics = EngineMetrics()
    a, b = _request("a", 4, num_output=1), _request("b", 4, num_output=1)
    result = _result("a", "a", "a", "b")
    result.drafts = [Drafts("a", 3, 2), Drafts("b", 4, 0)]  # a: two drafts accepted and one more token
    metrics.observe_step([a, b], result)
    assert metrics.iteration_tokens.count == 1 and metrics.iteration_tokens.sum == 4
    spec = metrics.spec_decode
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (2, 7, 2)
    assert spec.accepted_per_pos == [1, 1, 0, 0]


def test_a_readiness_probe_is_in_no_series():
    metrics = EngineMetrics()
    probe = _request("probe", 1, is_probe=True)
    metrics.observe_step([probe], _result("probe"))
    metrics.observe_finished(probe)
    assert metrics.iteration_tokens.count == 0 and metrics.request_num_preemptions.count == 0
    preempted = _request("twice", 3)
    preempted.num_preemptions = 2
    metrics.observe_finished(preempted)
    assert metrics.request_num_preemptions.counts == [0, 1, 1, 1, 1, 1, 1] and metrics.request_num_preemptions.sum == 2
