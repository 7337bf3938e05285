"""The slots scheduler (static-shape workers) without a model: slots, chunking, alternation, limits."""

from __future__ import annotations

from services.scheduler.slot_manager import SlotManager
from services.scheduler.slot_scheduler import SlotScheduler
from tests.test_scheduler import req, run_step


def make(num_slots=2, ctx_len=64, chunk=8) -> SlotScheduler:
    return SlotScheduler(SlotManager(num_slots, ctx_len), chunk)


def test_a_prompt_is_prefilled_in_chunks_then_decoded():
    s = make(chunk=8)
    s.add_request(req("a", 20, max_tokens=3))
    plans = [run_step(s)[0] for _ in range(5)]
    assert [p.num_new_tokens for p in plans] == [{"a": 8}, {"a": 8}, {"a": 4}, {"a": 1}, {"a": 1}]
    assert plans[0].step.new_seqs[0].block_ids == [0]  # its slot
    assert not s.requests and s.kv.free_slots == [1, 0]  # done: its slot is free again


def test_steps_never_mix_prefill_and_decode_and_alternate_while_a_prompt_fills():
    s = make(num_slots=3, chunk=4)
    s.add_request(req("a", 2, max_tokens=50))
    s.add_request(req("b", 2, max_tokens=50))
    assert [run_step(s)[0].num_new_tokens for _ in range(2)] == [{"a": 2}, {"a": 1}]  # a decodes before b joins
    s.add_request(req("c", 16, max_tokens=50))
    rows = [run_step(s)[0].num_new_tokens for _ in range(8)]
    for r in rows:  # one sequence's chunk, or one token for every decoding slot
        assert len(r) == 1 and next(iter(r.values())) > 1 or all(n == 1 for n in r.values())
    assert rows == [{"b": 2}, {"a": 1, "b": 1}, {"c": 4}, {"a": 1, "b": 1}, {"c": 4}, {"a": 1, "b": 1},
                    {"c": 4}, {"a": 1, "b": 1}]


def test_requests_wait_for_a_free_slot():
    s = make(num_slots=1)
    s.add_request(req("a", 4, max_tokens=2))
    s.add_request(req("b", 4, max_tokens=2))
    seen = [set(run_step(s)[0].num_new_tokens) for _ in range(4)]
    assert seen == [{"a"}, {"a"}, {"b"}, {"b"}]
    assert s.requests == {}


def test_aborting_frees_the_slot_and_tells_the_worker():
    s = make(num_slots=1)
    s.add_request(req("a", 4, max_tokens=10))
    run_step(s)
    s.abort("a")
    s.add_request(req("b", 4))
    plan, _ = run_step(s)
    assert plan.step.dropped_ids == ["a"] and plan.step.new_seqs[0].block_ids == [0]


def test_a_slot_holds_ctx_len_tokens():
    slots = SlotManager(2, ctx_len=16)
    assert slots.can_ever_fit(16) and not slots.can_ever_fit(17)
    r = req("a", 10)
    assert slots.allocate_slots(r, 10) == [] and slots.block_ids("a") == [1 - 1]
    r.num_computed_tokens = 10
    assert slots.allocate_slots(r, 7) is None and slots.usage == 0.5
