"""Runs one Step on a backend: apply its deltas to the sequence table, one ragged forward, sample.

What is the same on every accelerator lives here (the sequence table, which rows sample, prompt
logprobs, the multi-step loop, a row that fails failing alone); the backend does the rest.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from services.worker import memory
from services.worker.backends.base import Backend, BatchRow
from services.worker.draft_proposer import DraftModelProposer
from services.worker.eagle_proposer import Eagle3Proposer
from services.worker.guided import GrammarCompiler
from services.worker.kv_tier import HostTier
from services.worker.lora.manager import LoraManager
from services.worker.ngram import NgramProposer
from services.worker.pooling import pool
from services.worker.sampler import logprobs_of
from services.worker.sequence import SeqState
from services.worker.suffix import SuffixProposer
from shared.wire.images import ImageRef
from shared.wire.messages import FinishReason, Logprobs, NewSeq, Sampled, ScheduledSeq, Step
from shared.wire.spec_decode import Drafts

Proposer = NgramProposer | SuffixProposer | DraftModelProposer | Eagle3Proposer


class SequenceDrift(RuntimeError):
    """The worker's count of a sequence's computed tokens differs from the scheduler's."""


@dataclass
class StepOutput:
    sampled: list[Sampled]
    finished: dict[str, SeqState]  # sequences that ended this step (state already dropped)
    logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)  # of each sampled token, when asked
    prompt_logprobs: dict[str, list[Logprobs | None]] = field(default_factory=dict)  # with a first token
    embeddings: dict[str, bytes] = field(default_factory=dict)  # pooling rows' (float32, little-endian)
    drafts: list[Drafts] = field(default_factory=list)  # rows that verified draft tokens

    def merge(self, later: StepOutput) -> None:
        """A later sampling round of the same step (speculative decoding's accepted positions)."""
        self.sampled += later.sampled
        self.finished.update(later.finished)
        for request_id, logprobs in later.logprobs.items():
            self.logprobs.setdefault(request_id, []).extend(logprobs)


class ModelRunner:
    def __init__(self, backend: Backend, max_model_len: int, eos_token_ids: list[int],
                 grammar: GrammarCompiler | None = None, rebuild: Callable[[], Backend] | None = None,
                 lora: LoraManager | None = None, proposer: Proposer | None = None, tier: HostTier | None = None):
        """rebuild: a fresh backend from the model file (sleep mode's wake); None: this worker cannot sleep.
        lora: the adapters attached to the backend's model (None: it serves the base model alone).
        proposer: speculative decoding's drafts for rows given lookahead slots (None: it does not speculate).
        tier: the host KV tier this worker copies blocks to and from (None: --kv-offloading-size 0)."""
        self.backend: Backend | None = backend
        self.lora = lora
        self.rebuild = rebuild
        self._num_blocks = 0  # the KV pool's, while asleep: the one the wake must give back
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.grammar = grammar
        self.proposer = proposer
        self.tier = tier
        self.seqs: dict[str, SeqState] = {}
        self._row_errors: dict[str, str] = {}  # this iteration's rows that failed on their own

    # ---- sleep mode (the scheduler parks this worker's pool first) --------------------------------

    @property
    def is_sleeping(self) -> bool:
        return self.backend is None

    def sleep(self) -> None:
        """Let go of the backend, its weights and KV pool with it, and of every sequence (the
        scheduler recomputes them after the wake), then hand the freed memory back to the OS."""
        if self.rebuild is None:
            raise RuntimeError("this worker cannot sleep: its backend compiles in the background (--compile)")
        if self.backend is None:
            return  # asleep already
        self.seqs.clear()
        self._row_errors.clear()
        self._num_blocks = self.backend.num_blocks
        self.backend = None
        gc.collect()
        memory.trim()

    def wake_up(self) -> None:
        """A backend built again from the model file, with the KV pool the scheduler knows."""
        if self.backend is not None:
            return
        backend = self.rebuild()
        if backend.num_blocks != self._num_blocks:
            raise RuntimeError(f"woke with {backend.num_blocks} KV blocks, not the {self._num_blocks} announced")
        if self.lora is not None:
            self.lora.attach_to(backend.model)
        backend.warm_up()
        self.backend = backend

    # ---- deltas ------------------------------------------------------------------------------

    def apply_deltas(self, step: Step) -> list[BatchRow]:
        """Returns (sequence, num_new_tokens) in batch order."""
        if step.reset:
            self.seqs.clear()
        for request_id in step.dropped_ids:
            self.seqs.pop(request_id, None)
        batch = []
        for new in step.new_seqs:
            state = SeqState.from_new(new)
            if new.lora is not None and (self.lora is None or new.lora not in self.lora.served):
                self._row_errors[new.request_id] = f"LoRA adapter {new.lora!r} is not loaded on this worker"
                continue
            if new.images and (why := self._images_unavailable(new)) is not None:
                self._row_errors[new.request_id] = why
                continue
            if new.sampling.guided is not None:
                try:
                    state.matcher = self._grammar().matcher(new.sampling.guided)
                    state.matcher.advance(state.output_ids)  # recomputed after preemption: catch up
                except Exception as exc:  # this request's grammar: it fails alone
                    self._row_errors[new.request_id] = _describe(exc)
                    continue
            self.seqs[new.request_id] = state
            batch.append((state, new.num_new_tokens))
        for sched in step.scheduled:
            state = self.seqs[sched.request_id]
            if state.num_computed_tokens != sched.num_computed_tokens:
                raise SequenceDrift(f"{sched.request_id}: the worker has computed {state.num_computed_tokens} "
                                    f"tokens, the scheduler counts {sched.num_computed_tokens}")
            state.block_table.extend(sched.new_block_ids)
            batch.append((state, sched.num_new_tokens))
        return batch

    def images_to_fetch(self, step: Step) -> list[ImageRef]:
        """The step's new sequences' images this worker has neither encoded nor fetched, one per key
        (the worker service fetches them from the media store before the step runs)."""
        if self.backend.images is None:
            return []
        return list({i.key: i for new in step.new_seqs for i in self.backend.images.missing(new.images)}.values())

    def add_image(self, image: ImageRef, pixels: bytes) -> None:
        self.backend.images.add_pixels(image, pixels)

    def _images_unavailable(self, new: NewSeq) -> str | None:
        if self.backend.images is None:
            return f"this worker's backend ({self.backend.name.value}) does not run images"
        return self.backend.images.unavailable(new.images)

    # ---- one iteration -----------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, step: Step) -> StepOutput:
        """A failure of the forward fails the step; a failure of one row's grammar or sampling
        fails that row's sequence only (a Sampled with finish_reason ERROR), and the others go on."""
        self._row_errors = {}
        if step.kv_saves or step.kv_loads or step.kv_spills or step.kv_disk_loads:
            if self.tier is None:
                raise RuntimeError("the Step moves KV blocks to or from a host tier this worker does not have")
            self.tier.transfer(self.backend.kv_tensors(), step.kv_saves, step.kv_loads, step.kv_spills,
                               step.kv_disk_loads)
            try:
                return self._execute(step)
            finally:
                self.tier.settle()  # a GPU's copies ran beside the forward: landed before the Step is answered
        return self._execute(step)

    def _execute(self, step: Step) -> StepOutput:
        batch = self.apply_deltas(step)
        if not batch:
            return self._record([], [], [])
        if self.backend.encoder is not None:
            return self._encode(batch)
        starts = [seq.num_computed_tokens for seq, _ in batch]
        if self.proposer is not None:
            batch = self._add_drafts(batch, {row.request_id: row.num_lookahead for row in step.scheduled})
        out = self._sample_after(batch, self.forward(batch))
        if self.proposer is not None:
            self.proposer.observe(self.backend, batch, starts, self.seqs)
        return out

    def _sample_after(self, batch: list[BatchRow], all_hidden: torch.Tensor) -> StepOutput:
        """The forward's outputs: prompt logprobs, embeddings, one token per row that has computed
        every known token, and the drafts verified."""
        # only sequences whose every known token is now computed produce a token (from the row of
        # their last known token: a row's drafts follow it)
        rows, to_sample, end = [], [], 0
        for seq, num_new in batch:
            if seq.prompt_logprobs is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
                self._score_prompt(seq, all_hidden[end : end + num_new])
            end += num_new
            seq.num_computed_tokens += num_new - len(seq.draft_ids)
            if seq.num_computed_tokens == len(seq.token_ids):
                rows.append(end - 1 - len(seq.draft_ids))
                to_sample.append(seq)
        if not to_sample:
            return self._record([], [], [])
        hidden = _select(all_hidden, rows)
        pooled = {s.request_id: pool(hidden[i], s.sampling.pooling) for i, s in enumerate(to_sample)
                  if s.sampling.pooling is not None}
        if pooled:  # their output is the embedding: they sample nothing
            keep = [i for i, s in enumerate(to_sample) if s.request_id not in pooled]
            to_sample, hidden, rows = [to_sample[i] for i in keep], hidden[keep], [rows[i] for i in keep]
        drafting = [(seq, row) for seq, row in zip(to_sample, rows, strict=True) if seq.draft_ids]
        logits = draft_logits = None
        if drafting:  # the logits after each draft too, in the same pass over the output weights
            draft_rows = [row + 1 + i for seq, row in drafting for i in range(len(seq.draft_ids))]
            logits = self.backend.compute_logits(_select(all_hidden, rows + draft_rows))
            logits, draft_logits = logits[: len(rows)], logits[len(rows) :]
        token_ids, logprobs = self._sample(to_sample, hidden, logits) if to_sample else ([], [])
        out = self._record(to_sample, token_ids, logprobs, pooled)
        if drafting:
            self._verify(out, drafting, all_hidden, draft_logits)
        return out

    def _sample(self, seqs: list[SeqState], hidden: torch.Tensor,
                logits: torch.Tensor | None = None) -> tuple[list[int], list[Logprobs | None]]:
        """One token per row from its hidden state (or its logits, computed already)."""
        try:
            rows_in = [s.sample_row(self.eos_token_ids) for s in seqs]
            return self.backend.sample(self.backend.compute_logits(hidden) if logits is None else logits, rows_in)
        except Exception:  # some row's processors raised: sample each row alone, to find which
            return self._sample_each(seqs, hidden)

    # ---- speculative decoding ------------------------------------------------------------------

    def _add_drafts(self, batch: list[BatchRow], lookahead: dict[str, int]) -> list[BatchRow]:
        """Each decode row the scheduler gave lookahead slots gets the proposer's draft tokens, as
        many as its slots, its max_tokens and the context leave room for."""
        rooms = []
        for seq, num_new in batch:
            seq.draft_ids = []
            room = lookahead.get(seq.request_id, 0)
            if room and num_new == 1 and seq.num_computed_tokens == len(seq.token_ids) - 1:
                rooms.append((seq, min(room, seq.max_drafts or room, seq.sampling.max_tokens - seq.num_output_tokens - 1,
                                       self.max_model_len - len(seq.token_ids),
                                       len(seq.block_table) * self.backend.block_size - len(seq.token_ids))))
        self.proposer.propose_rows(self.backend, rooms)
        return [(seq, num_new + len(seq.draft_ids)) for seq, num_new in batch]

    def _verify(self, out: StepOutput, drafting: list[tuple[SeqState, int]], hidden: torch.Tensor,
                logits: torch.Tensor) -> None:
        """Each drafting row's token was sampled from its last known token's row as usual; while it
        equals the next draft, the draft's KV (computed in this forward) is kept and the token after it
        is sampled from the draft's row, as a step without drafts would have sampled it (the same
        processors, the same draw per output index). With one proposal per position, that is
        rejection sampling exactly (docs/speculative_decoding.md). logits: those after each draft, in
        the drafting rows' order."""
        num_accepted = dict.fromkeys((seq.request_id for seq, _ in drafting), 0)
        first, at = {}, 0
        for seq, _ in drafting:
            first[seq.request_id], at = at, at + len(seq.draft_ids)
        position = 0
        while drafting:
            drafting = [(seq, row) for seq, row in drafting if seq.request_id in self.seqs
                        and position < len(seq.draft_ids) and seq.token_ids[-1] == seq.draft_ids[position]]
            for seq, _ in drafting:
                seq.num_computed_tokens += 1
                num_accepted[seq.request_id] += 1
            if drafting:
                seqs = [seq for seq, _ in drafting]
                index = [first[seq.request_id] + position for seq in seqs]
                token_ids, logprobs = self._sample(seqs, _select(hidden, [row + 1 + position for _, row in drafting]),
                                                   logits[index])
                out.merge(self._record(seqs, token_ids, logprobs))
            position += 1
        for request_id, accepted in num_accepted.items():
            seq = self.seqs.get(request_id) or out.finished[request_id]
            out.drafts.append(Drafts(request_id, len(seq.draft_ids), accepted))
            # each draft costs its row a token's compute: after a miss, draft one past the last kept
            # next time; after all were kept, one more (docs/speculative_decoding.md)
            seq.max_drafts = len(seq.draft_ids) + 1 if accepted == len(seq.draft_ids) else accepted + 1
            seq.num_missed = 0 if accepted else seq.num_missed + 1
            seq.draft_ids = []
            # a draft model's KV past the kept tokens is of rejected drafts: computed again next time
            seq.draft_computed = min(seq.draft_computed, seq.num_computed_tokens)

    def forward(self, batch: list[BatchRow]) -> torch.Tensor:
        """The ragged forward, with each row's LoRA adapter (if any) in place for its tokens."""
        if self.lora is None:
            return self.backend.forward(self.backend.prepare(batch))
        self.lora.activate([seq.lora for seq, _ in batch], [n for _, n in batch], self.backend.device)
        try:
            return self.backend.forward(self.backend.prepare(batch))
        finally:
            self.lora.deactivate()

    def _encode(self, batch: list[tuple[SeqState, int]]) -> StepOutput:
        """An encoder (models/bert.py) attends both ways, so each prompt is encoded whole at its last
        chunk (the chunks before compute nothing; the KV pool is not used). A row that asks for
        tokens instead of an embedding fails alone."""
        done = []
        for seq, num_new in batch:
            seq.num_computed_tokens += num_new
            if seq.num_computed_tokens < len(seq.token_ids):
                continue
            if seq.sampling.pooling is None:
                self._row_errors[seq.request_id] = (f"{self.backend.config.architecture} is an encoder: "
                                                    "it embeds and scores, and generates no tokens")
            else:
                done.append(seq)
        pooled = {}
        if done:
            vectors = self.backend.encoder.embed([s.token_ids for s in done])
            pooled = {s.request_id: pool(vectors[i], s.sampling.pooling) for i, s in enumerate(done)}
        return self._record([], [], [], pooled)

    def _sample_each(self, seqs: list[SeqState], hidden: torch.Tensor) -> tuple[list[int], list[Logprobs | None]]:
        """The slow path after a failed batch draw (the logits are recomputed: processors work in
        place). A row that raises gets token -1 and its error; the others draw as they would have."""
        token_ids, logprobs = [], []
        for i, seq in enumerate(seqs):
            try:
                ids, lps = self.backend.sample(self.backend.compute_logits(hidden[i : i + 1]),
                                               [seq.sample_row(self.eos_token_ids)])
            except Exception as exc:
                self._row_errors[seq.request_id] = _describe(exc)
                ids, lps = [-1], [None]
            token_ids += ids
            logprobs += lps
        return token_ids, logprobs

    def iterations(self, step: Step) -> Iterator[Step]:
        """The Step, then (multi-step) its next decode iterations over the rows still running.
        Each is yielded for `execute`; the next is formed once the previous has run."""
        yield step
        for _ in range(step.num_steps - 1):
            rows = [ScheduledSeq(row.request_id, 1, self.seqs[row.request_id].num_computed_tokens,
                                 num_lookahead=row.num_lookahead)
                    for row in step.scheduled if row.request_id in self.seqs]
            if not rows:
                return
            yield Step(step_id=step.step_id, scheduled=rows)

    def _score_prompt(self, seq: SeqState, hidden: torch.Tensor) -> None:
        """Logprobs of prompt tokens: the row at position p scores the prompt token at p + 1."""
        first = seq.num_computed_tokens
        num_rows = min(hidden.shape[0], seq.num_prompt_tokens - 1 - first)
        if num_rows <= 0:
            return
        logprobs = self.backend.compute_logits(hidden[:num_rows]).log_softmax(-1).cpu()
        targets = seq.token_ids[first + 1 : first + 1 + num_rows]
        seq.prompt_logprobs.extend(logprobs_of(logprobs, targets, seq.sampling.prompt_logprobs))

    def _record(self, seqs: list[SeqState], token_ids: list[int], logprobs: list[Logprobs | None],
                pooled: dict[str, bytes] | None = None) -> StepOutput:
        out = StepOutput(sampled=[], finished={}, embeddings=pooled or {})
        for request_id, embedding in out.embeddings.items():
            self.seqs[request_id].embedding = embedding
            out.sampled.append(Sampled(request_id=request_id, token_id=-1, finish_reason=FinishReason.STOP))
            out.finished[request_id] = self.seqs.pop(request_id)
        errors, self._row_errors = self._row_errors, {}  # a later round of the step has its own
        for request_id, error in errors.items():
            out.sampled.append(Sampled(request_id=request_id, token_id=-1, finish_reason=FinishReason.ERROR,
                                       error=error))
            state = self.seqs.pop(request_id, None)
            if state is not None:
                out.finished[request_id] = state
        for seq, token_id, lp in zip(seqs, token_ids, logprobs, strict=True):
            if seq.request_id in errors:
                continue
            seq.token_ids.append(token_id)
            if seq.matcher is not None:
                seq.matcher.advance([token_id])
            if lp is not None:
                out.logprobs[seq.request_id] = [lp]
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


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _select(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden[rows]; on a GPU the index goes over from pinned memory, so the host does not wait
    for the forward here (the sampled ids are the step's one sync)."""
    index = torch.tensor(rows, dtype=torch.int64)
    if hidden.is_cuda:
        index = index.pin_memory().to(hidden.device, non_blocking=True)
    return hidden.index_select(0, index)
