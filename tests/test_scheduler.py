"""Scheduler logic without a model: budgets, chunking, joining and leaving, aborts, preemption."""

from __future__ import annotations

from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler import Scheduler
from services.scheduler.static_scheduler import StaticScheduler
from shared.wire.hashing import root_hash
from shared.wire.messages import FinishReason, Sampled, SamplingParams, StepResult


def make(num_blocks=16, block_size=4, max_num_seqs=4, budget=8) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size, root_hash("m", "auto")), max_num_seqs, budget)


def req(request_id: str, n: int, max_tokens: int = 4, first: int = 0) -> Request:
    return Request(request_id, list(range(first, first + n)), SamplingParams(max_tokens=max_tokens),
                   reply_to="r")


def run_step(s: Scheduler, finish: set[str] = frozenset(), token: int = 7):
    """Pretend the worker ran the plan: every request whose known tokens are all computed samples."""
    plan = s.schedule()
    sampled = []
    for rid, n in plan.num_new_tokens.items():
        r = s.requests[rid]
        if r.num_computed_tokens + n == r.num_tokens:
            done = rid in finish or len(r.output_token_ids) + 1 >= r.sampling.max_tokens
            sampled.append(Sampled(rid, token, FinishReason.LENGTH if done else None))
    return plan, s.update(plan, StepResult(step_id=plan.step.step_id, sampled=sampled))


def test_long_prompt_is_chunked_by_the_token_budget():
    s = make(budget=8)
    s.add_request(req("a", 20))
    plans = [run_step(s)[0].num_new_tokens["a"] for _ in range(3)]
    assert plans == [8, 8, 4]
    assert s.requests["a"].output_token_ids == [7]  # sampled only once the prompt was complete


def test_decodes_go_first_and_new_requests_join_next_step():
    s = make(budget=8)
    s.add_request(req("a", 6))
    plan, _ = run_step(s)
    assert plan.num_new_tokens == {"a": 6} and [n.request_id for n in plan.step.new_seqs] == ["a"]
    s.add_request(req("b", 10, first=100))
    plan, _ = run_step(s)
    assert plan.num_new_tokens == {"a": 1, "b": 7}  # a's decode first, b takes the rest of the budget
    assert [x.request_id for x in plan.step.scheduled] == ["a"] and plan.step.scheduled[0].new_block_ids == []


def test_finished_requests_leave_at_once_and_free_blocks():
    s = make()
    s.add_request(req("a", 4, max_tokens=1))
    _, finished = run_step(s)
    assert [f.request.request_id for f in finished] == ["a"]
    assert s.running == [] and s.kv.pool.num_free == 16 and not s.has_work


def test_max_num_seqs_caps_the_batch():
    s = make(max_num_seqs=2, budget=64)
    for i in range(3):
        s.add_request(req(f"r{i}", 4, first=10 * i))
    plan, _ = run_step(s)
    assert sorted(plan.num_new_tokens) == ["r0", "r1"] and [r.request_id for r in s.waiting] == ["r2"]


def test_abort_frees_blocks_and_tells_the_worker():
    s = make()
    s.add_request(req("a", 6))
    run_step(s)
    assert s.kv.pool.num_free == 14
    s.abort("a")
    assert s.kv.pool.num_free == 16
    plan = s.schedule()
    assert plan.step.dropped_ids == ["a"] and plan.num_new_tokens == {}


def test_preemption_takes_the_youngest_and_recomputes_it_first():
    # 4 blocks of 4 tokens: two 7-token prompts fill them once each grows to 9 tokens
    s = make(num_blocks=4, budget=64)
    s.add_request(req("old", 7, max_tokens=8))
    s.add_request(req("young", 7, max_tokens=8, first=100))
    run_step(s)  # both prefill (2 blocks each), both sample a token -> 8 tokens each
    plan, _ = run_step(s)  # both decode the 8th token in their 2nd block
    plan = s.schedule()  # 9th token needs a third block: none free -> preempt young
    assert s.num_preemptions == 1
    young = s.requests["young"]
    assert young.status == RequestStatus.PREEMPTED and young.num_computed_tokens == 0
    assert list(s.waiting) == [young] and plan.step.dropped_ids == ["young"]
    assert list(plan.num_new_tokens) == ["old"] and s.kv.block_ids("young") == []


def test_worker_forgets_everything_on_a_reset_step():
    from services.worker.model_runner import ModelRunner
    from shared.wire.messages import Step

    runner = ModelRunner(backend=None, max_model_len=64, eos_token_ids=[])
    runner.seqs["stale"] = object()
    assert runner.apply_deltas(Step(step_id=1, reset=True)) == [] and runner.seqs == {}


def test_prefix_cache_stats_count_each_request_once():
    s = make(num_blocks=4, budget=64)
    s.add_request(req("a", 9, max_tokens=1))
    run_step(s)  # a: 9 tokens, 2 full blocks cached, then finished and freed
    s.add_request(req("big", 14, max_tokens=1, first=100))  # 4 blocks: fits
    s.add_request(req("b", 9, max_tokens=1))  # waits behind big; its retries must not count
    run_step(s)
    run_step(s)
    assert s.kv.num_queried_tokens == 9 + 14 + 9
    assert s.kv.num_hit_tokens == 0  # big evicted a's cached blocks before b got in


def test_scheduler_refuses_a_worker_whose_kv_geometry_differs_from_the_models_other_workers():
    from services.scheduler.pools import worker_mismatch
    from shared.wire.messages import BackendName, WorkerHello, WorkerKind

    def hello(worker_id="w", **fields):
        base = dict(worker_id=worker_id, model="m", backend=BackendName.TORCH_CPU, kind=WorkerKind.PAGED,
                    num_blocks=10, block_size=16, max_batch=8, dtype="float32", max_model_len=2048,
                    kv_cache_dtype="auto")
        return WorkerHello(**(base | fields))

    first = hello("w0")
    assert worker_mismatch([], hello(block_size=32)) is None  # the first worker's geometry is the model's
    assert worker_mismatch([first], hello(num_blocks=99)) is None  # pools may differ in size
    assert worker_mismatch([first], hello(block_size=32)) == \
        "block_size 32 != 16 of worker w0, which already serves 'm'"
    assert "kv_cache_dtype 'bfloat16' != 'auto'" in worker_mismatch([first], hello(kv_cache_dtype="bfloat16"))
    assert "max_model_len 1024 != 2048" in worker_mismatch([first], hello(max_model_len=1024))
    assert worker_mismatch([], hello(kind=WorkerKind.SLOTS)) is None  # it gets a slot allocator
    # a slots worker beside a paged one: compared only with workers of its own kind
    slots = hello("q0", kind=WorkerKind.SLOTS, num_blocks=4, block_size=256, max_model_len=256)
    assert worker_mismatch([first], slots) is None
    assert "block_size 128 != 256 of worker q0" in worker_mismatch([first, slots], hello(
        kind=WorkerKind.SLOTS, block_size=128, max_model_len=256))


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    s = make(num_blocks=8, budget=64)
    s.add_request(req("a", 9, max_tokens=1))
    run_step(s)
    scored = Request("b", list(range(9)), SamplingParams(max_tokens=1, prompt_logprobs=1), reply_to="r")
    s.add_request(scored)
    plan, _ = run_step(s)
    assert plan.num_new_tokens == {"b": 9}  # every prompt token computed, though 2 blocks were cached
    assert s.kv.num_hit_tokens == 0


def test_model_wide_cap_holds_requests_in_waiting():
    running_elsewhere = 3
    s = Scheduler(KVCacheManager(16, 4, root_hash("m", "auto")), 4, 64,
                  can_run_more=lambda: running_elsewhere + len(s.running) < 5)
    for i in range(3):
        s.add_request(req(f"r{i}", 4, first=10 * i))
    plan, _ = run_step(s)
    assert sorted(plan.num_new_tokens) == ["r0", "r1"] and [r.request_id for r in s.waiting] == ["r2"]


def test_deadline_is_wall_clock_and_zero_means_none():
    r = req("a", 4)
    assert not r.is_past_deadline(1e12)
    r.deadline = 100.0
    assert not r.is_past_deadline(99.0) and r.is_past_deadline(101.0)


def test_static_batching_admits_nothing_until_the_batch_is_done():
    s = StaticScheduler(KVCacheManager(16, 4, root_hash("m", "auto")), 2, 64)
    s.add_request(req("short", 4, max_tokens=1))
    s.add_request(req("long", 4, max_tokens=3, first=10))
    s.add_request(req("late", 4, max_tokens=1, first=20))
    plan, finished = run_step(s)
    assert sorted(plan.num_new_tokens) == ["long", "short"] and [f.request.request_id for f in finished] == ["short"]
    plan, _ = run_step(s)
    assert list(plan.num_new_tokens) == ["long"]  # a free seat, but the batch is still running
    run_step(s)
    plan, _ = run_step(s)
    assert list(plan.num_new_tokens) == ["late"]
    continuous = make(max_num_seqs=2, budget=64)
    for r in (req("short", 4, max_tokens=1), req("long", 4, max_tokens=3, first=10), req("late", 4, 1, first=20)):
        continuous.add_request(r)
    run_step(continuous)
    plan, _ = run_step(continuous)
    assert sorted(plan.num_new_tokens) == ["late", "long"]  # continuous: the seat is taken at once


def test_a_long_prompt_takes_a_bounded_share_while_short_ones_wait_and_the_whole_budget_alone():
    s = make(num_blocks=64, budget=16)  # the share: a quarter of the budget, 4 tokens
    s.add_request(req("long", 100, max_tokens=2))
    assert run_step(s)[0].num_new_tokens == {"long": 16}  # alone: the whole budget
    s.add_request(req("s1", 3, max_tokens=3, first=200))
    s.add_request(req("s2", 4, max_tokens=3, first=300))
    plan, _ = run_step(s)
    assert plan.num_new_tokens == {"long": 4, "s1": 3, "s2": 4}  # both short ones in the very next step
    plan, _ = run_step(s)
    assert plan.num_new_tokens == {"s1": 1, "s2": 1, "long": 14}  # decode rows first; long alone again
    assert s.requests["s1"].output_token_ids == [7, 7]


def test_a_long_prompt_keeps_the_whole_budget_when_the_waiting_ones_cannot_get_in():
    s = make(num_blocks=64, budget=16, max_num_seqs=1)
    s.add_request(req("long", 100, max_tokens=2))
    s.add_request(req("short", 3, max_tokens=2, first=200))  # max_num_seqs is 1: it waits for long
    assert [run_step(s)[0].num_new_tokens for _ in range(2)] == [{"long": 16}, {"long": 16}]


def prio(request_id: str, n: int, priority: int, max_tokens: int = 8, first: int = 0) -> Request:
    r = req(request_id, n, max_tokens, first)
    r.priority = priority
    return r


def test_waiting_requests_are_admitted_best_priority_first_then_by_arrival():
    s = make(max_num_seqs=1, budget=64)
    for rid, p in (("batch-1", 1), ("batch-2", 1), ("chat", 0), ("urgent", -1)):
        s.add_request(prio(rid, 4, p, first=ord(rid[-1]) * 10))
    assert [r.request_id for r in s.waiting] == ["urgent", "chat", "batch-1", "batch-2"]


def test_rows_of_a_worse_priority_sit_out_a_better_prompt_then_go_on():
    s = make(num_blocks=64, max_num_seqs=4, budget=64)
    s.add_request(prio("batch", 4, 1))
    run_step(s)  # batch's prompt; it decodes from now on
    assert run_step(s)[0].num_new_tokens == {"batch": 1}
    s.add_request(prio("chat", 12, 0, first=100))
    plan, _ = run_step(s)
    assert plan.num_new_tokens == {"chat": 12}  # chat's prompt alone: batch's decode sat out
    plan, _ = run_step(s)
    assert plan.num_new_tokens == {"chat": 1, "batch": 1}  # decodes share the step again
    assert len(s.requests["batch"].output_token_ids) == 3


def test_held_rows_go_when_the_better_prompt_cannot():
    s = make(num_blocks=4, block_size=4, max_num_seqs=4, budget=64)
    s.add_request(prio("batch", 8, 1, max_tokens=4))
    run_step(s)  # 2 of 4 blocks; decoding needs a third
    s.add_request(prio("chat", 16, 0, first=100))  # 4 blocks: not while batch holds 2
    plan, _ = run_step(s)
    assert plan.num_new_tokens == {"batch": 1}  # chat could not be admitted, so batch was not held


def test_the_worst_priority_is_preempted_first_even_when_it_is_the_oldest():
    s = make(num_blocks=4, block_size=4, max_num_seqs=4, budget=64)
    s.add_request(prio("batch", 4, 1, max_tokens=8, first=100))
    run_step(s)
    s.add_request(prio("chat", 4, 0, max_tokens=8))
    s.add_request(prio("chat-2", 4, 0, max_tokens=8, first=200))
    assert run_step(s)[0].num_new_tokens == {"chat": 4, "chat-2": 4}
    plan, _ = run_step(s)  # both chats need a second block, one is free: batch gives up its own
    assert plan.num_new_tokens == {"chat": 1, "chat-2": 1} and s.num_preemptions == 1
    assert s.requests["batch"].status == RequestStatus.PREEMPTED and s.waiting[0].request_id == "batch"
