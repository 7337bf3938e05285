"""What a worker sends again when a client asks (after an outage): from the offset, as published."""

from __future__ import annotations

from services.worker.resend import MAX_FINISHED, SentTokens
from services.worker.sequence import SeqState
from shared.wire.messages import FinishReason, Logprobs, NewSeq, SamplingParams


def _seq(request_id: str, outputs: list[int], num_sent: int, logprobs: bool = False, **fields) -> SeqState:
    new = NewSeq(request_id=request_id, token_ids=[1, 2, 3], num_prompt_tokens=3, num_computed_tokens=0,
                 num_new_tokens=3, block_ids=[0], sampling=SamplingParams(logprobs=0 if logprobs else None),
                 reply_to="sy.v1.out.me", num_cached_tokens=2, first_scheduled_at=7.0)
    seq = SeqState.from_new(new)
    seq.token_ids += outputs
    seq.num_sent = num_sent
    if logprobs:
        seq.sent_logprobs = [Logprobs(-float(t)) for t in outputs[:num_sent]]
    for name, value in fields.items():
        setattr(seq, name, value)
    return seq


def test_a_live_sequence_is_sent_from_the_offset_up_to_what_was_published():
    sent = SentTokens({"r": _seq("r", [10, 11, 12], num_sent=2)})
    entry = sent.entry_from("r", "sy.v1.out.me", 1)
    assert (entry.offset, entry.token_ids, entry.finish_reason) == (1, [11], None)
    first = sent.entry_from("r", "sy.v1.out.me", 0)
    assert first.token_ids == [10, 11] and (first.num_prompt_tokens, first.num_cached_tokens) == (3, 2)
    assert sent.entry_from("r", "sy.v1.out.me", 2) is None  # nothing published past it yet
    assert sent.entry_from("r", "sy.v1.out.someone-else", 0) is None  # only to the subject it belongs to
    assert sent.entry_from("unknown", "sy.v1.out.me", 0) is None


def test_a_finished_sequence_sends_its_final_entry_again_with_logprobs():
    sent = SentTokens({})
    sent.remember_finished({"f": _seq("f", [10, 11], num_sent=2, logprobs=True, finish_reason=FinishReason.LENGTH)})
    entry = sent.entry_from("f", "sy.v1.out.me", 1)
    assert entry.token_ids == [11] and entry.finish_reason == FinishReason.LENGTH
    assert [lp.logprob for lp in entry.logprobs] == [-11.0]
    end = sent.entry_from("f", "sy.v1.out.me", 2)  # every token arrived, the finish did not
    assert end.token_ids == [] and end.finish_reason == FinishReason.LENGTH


def test_logprobs_a_recomputed_sequence_no_longer_has_end_the_request_with_an_error():
    seq = _seq("p", [10, 11, 12], num_sent=3, logprobs=True, logprobs_from=2)
    seq.sent_logprobs = [Logprobs(-12.0)]
    sent = SentTokens({"p": seq})
    assert [lp.logprob for lp in sent.entry_from("p", "sy.v1.out.me", 2).logprobs] == [-12.0]
    lost = sent.entry_from("p", "sy.v1.out.me", 1)
    assert lost.finish_reason == FinishReason.ERROR and "logprobs" in lost.error


def test_the_memory_of_finished_sequences_is_bounded():
    sent = SentTokens({})
    for i in range(MAX_FINISHED + 5):
        sent.remember_finished({f"r{i}": _seq(f"r{i}", [1], num_sent=1, finish_reason=FinishReason.STOP)})
    assert len(sent.finished) == MAX_FINISHED and "r0" not in sent.finished and f"r{MAX_FINISHED + 4}" in sent.finished


def test_only_a_bounded_tail_of_logprobs_is_kept_and_earlier_offsets_say_so():
    from services.worker.resend import KEEP_LOGPROBS
    from shared.wire.messages import TokenEntry

    seq = _seq("long", [], num_sent=0, logprobs=True)
    sent = SentTokens({"long": seq})
    for i in range(3 * KEEP_LOGPROBS):  # as the worker publishes: one token an entry
        seq.token_ids.append(1000 + i)
        sent.record(seq, TokenEntry("long", i, [1000 + i], logprobs=[Logprobs(-float(i))]))
    assert KEEP_LOGPROBS <= len(seq.sent_logprobs) <= 2 * KEEP_LOGPROBS
    tail = sent.entry_from("long", "sy.v1.out.me", 3 * KEEP_LOGPROBS - 2)
    assert tail.token_ids == [1000 + 3 * KEEP_LOGPROBS - 2, 1000 + 3 * KEEP_LOGPROBS - 1]
    assert [lp.logprob for lp in tail.logprobs] == [-(3.0 * KEEP_LOGPROBS - 2), -(3.0 * KEEP_LOGPROBS - 1)]
    assert sent.entry_from("long", "sy.v1.out.me", 5).finish_reason == FinishReason.ERROR
