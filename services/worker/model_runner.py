"""Runs one Step: apply its deltas to the sequence table, one ragged forward, sample."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.worker.attention import AttentionMetadata
from services.worker.compiled import MIN_DECODE_BLOCKS
from services.worker.guided import GrammarCompiler
from services.worker.sampler import logprobs_of, sample
from services.worker.sequence import SeqState
from shared.messages import FinishReason, Logprobs, Sampled, ScheduledSeq, Step


@dataclass
class StepOutput:
    sampled: list[Sampled]
    finished: dict[str, SeqState]  # sequences that ended this step (state already dropped)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)  # of the sampled token, when asked
    prompt_logprobs: dict[str, list[Logprobs | None]] = field(default_factory=dict)  # with a first token


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches, block_size: int, max_model_len: int,
                 eos_token_ids: list[int], grammar: GrammarCompiler | None = None):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.grammar = grammar
        self.seqs: dict[str, SeqState] = {}

    # ---- deltas ------------------------------------------------------------------------------

    def apply_deltas(self, step: Step) -> list[tuple[SeqState, int]]:
        """Returns (sequence, num_new_tokens) in batch order."""
        if step.reset:
            self.seqs.clear()
        for request_id in step.dropped_ids:
            self.seqs.pop(request_id, None)
        batch = []
        for new in step.new_seqs:
            state = SeqState.from_new(new)
            if new.sampling.guided is not None:
                state.matcher = self._grammar().matcher(new.sampling.guided)
                state.matcher.advance(state.output_ids)  # recomputed after preemption: catch up
            self.seqs[new.request_id] = state
            batch.append((state, new.num_new_tokens))
        for sched in step.scheduled:
            state = self.seqs[sched.request_id]
            state.block_table.extend(sched.new_block_ids)
            batch.append((state, sched.num_new_tokens))
        return batch

    # ---- one forward ---------------------------------------------------------------------------

    def build_inputs(self, batch: list[tuple[SeqState, int]]):
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        decode_rows, decode_tables, decode_lens, prefills = [], [], [], []
        for seq, num_new in batch:
            start = seq.num_computed_tokens
            row = len(input_ids)
            input_ids.extend(seq.token_ids[start : start + num_new])
            for pos in range(start, start + num_new):
                positions.append(pos)
                slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            num_blocks = (start + num_new + bs - 1) // bs
            if num_new == 1:
                decode_rows.append(row)
                decode_tables.append(seq.block_table[:num_blocks])
                decode_lens.append(start + 1)
            else:
                prefills.append((row, num_new, start, torch.tensor(seq.block_table[:num_blocks])))
        # at least MIN_DECODE_BLOCKS wide (masked padding), so compiled layers never see a 1-block table
        max_blocks = max((len(t) for t in decode_tables), default=0)
        max_blocks = max(max_blocks, MIN_DECODE_BLOCKS) if decode_tables else 0
        tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in decode_tables], dtype=torch.long)
        context_mask = (torch.arange(max_blocks * bs).unsqueeze(0) < torch.tensor(decode_lens).unsqueeze(1))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            decode_token_idx=torch.tensor(decode_rows, dtype=torch.long),
            decode_block_tables=tables.reshape(len(decode_tables), max_blocks),
            decode_context_mask=context_mask.reshape(len(decode_tables), 1, 1, max_blocks * bs),
            prefills=prefills,
        )
        return torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta

    @torch.inference_mode()
    def execute(self, step: Step) -> StepOutput:
        batch = self.apply_deltas(step)
        if not batch:
            return StepOutput(sampled=[], finished={})
        input_ids, positions, meta = self.build_inputs(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        # only sequences whose every known token is now computed produce a token
        rows, to_sample, end = [], [], 0
        for seq, num_new in batch:
            if seq.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
                self._score_prompt(seq, hidden[end : end + num_new])
            end += num_new
            seq.num_computed_tokens += num_new
            if seq.num_computed_tokens == len(seq.token_ids):
                rows.append(end - 1)
                to_sample.append(seq)
        if not to_sample:
            return StepOutput(sampled=[], finished={})
        logits = self.model.compute_logits(hidden[rows])
        token_ids, logprobs = sample(logits, [s.sample_row(self.eos_token_ids) for s in to_sample])
        return self._record(to_sample, token_ids, logprobs)

    def next_iteration(self, step: Step, num_done: int) -> Step | None:
        """Multi-step: the Step's next decode iteration, over its rows still running; None when done."""
        if num_done >= step.num_steps:
            return None
        rows = [ScheduledSeq(row.request_id, 1) for row in step.scheduled if row.request_id in self.seqs]
        return Step(step_id=step.step_id, scheduled=rows) if rows else None

    def _score_prompt(self, seq: SeqState, hidden: torch.Tensor) -> None:
        """Logprobs of prompt tokens: the row at position p scores the prompt token at p + 1."""
        first = seq.num_computed_tokens
        num_rows = min(hidden.shape[0], seq.num_prompt_tokens - 1 - first)
        if num_rows <= 0:
            return
        logprobs = self.model.compute_logits(hidden[:num_rows]).log_softmax(-1)
        targets = seq.token_ids[first + 1 : first + 1 + num_rows]
        seq.prompt_logprobs.extend(logprobs_of(logprobs, targets, seq.sampling.prompt_logprobs))

    def _record(self, seqs: list[SeqState], token_ids: list[int], logprobs: list[Logprobs | None]) -> StepOutput:
        out = StepOutput(sampled=[], finished={})
        for seq, token_id, lp in zip(seqs, token_ids, logprobs, strict=True):
            seq.token_ids.append(token_id)
            if seq.matcher is not None:
                seq.matcher.advance([token_id])
            if lp is not None:
                out.logprobs[seq.request_id] = lp
            if seq.prompt_logprobs is not None:
                out.prompt_logprobs[seq.request_id], seq.prompt_logprobs = seq.prompt_logprobs, None
            reason: FinishReason | None = seq.check_finished(token_id, self.eos_token_ids, self.max_model_len)
            out.sampled.append(Sampled(request_id=seq.request_id, token_id=token_id, finish_reason=reason))
            if reason is not None:
                out.finished[seq.request_id] = self.seqs.pop(seq.request_id)
        return out

    def _grammar(self) -> GrammarCompiler:
        if self.grammar is None:
            raise RuntimeError("this worker was started without a tokenizer: response_format is unavailable")
        return self.grammar
