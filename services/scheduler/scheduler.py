"""Iteration-level continuous batching for one worker pool.

Each iteration: running requests first (decode tokens, unfinished prefill chunks), then waiting
ones join while the token budget and max_num_seqs allow, best priority first. When a running
request needs a block and none is free, the youngest of the worst priority is preempted.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.scheduler.kv_manager import KVManager
from services.scheduler.request import Request, RequestStatus
from shared.wire.messages import FinishReason, NewSeq, ScheduledSeq, Step, StepResult


@dataclass
class SchedulerOutput:
    step: Step
    num_new_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens this step

    @property
    def is_empty(self) -> bool:
        return not (self.num_new_tokens or self.step.dropped_ids or self.step.kv_saves or self.step.kv_loads
                    or self.step.kv_spills)


@dataclass
class FinishedRequest:
    request: Request
    reason: FinishReason
    error: str | None = None  # the worker failed this row alone (the pool tells the client)


def _always() -> bool:
    return True


class Scheduler:
    def __init__(self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int,
                 can_run_more: Callable[[], bool] = _always, num_scheduler_steps: int = 1,
                 long_prefill_token_threshold: int = 0, max_loras: int = 0, num_speculative_tokens: int = 0,
                 spec_max_batch: int = 0):
        """long_prefill_token_threshold: while more than one request has a prompt to compute, each
        takes at most this many tokens a step (0: a quarter of the budget), so a long prompt does not
        hold back the first token of short ones; a prompt computed alone takes the whole budget.
        max_loras: the LoRA adapters one step may mix (the worker's slots).
        num_speculative_tokens, spec_max_batch: speculative decoding's lookahead slots per decode row,
        in steps of at most spec_max_batch running requests (0: the worker does not speculate)."""
        self.kv = kv
        self.long_prefill_tokens = long_prefill_token_threshold or max(kv.block_size, max_num_batched_tokens // 4)
        self.num_scheduler_steps = num_scheduler_steps
        self.num_speculative_tokens = num_speculative_tokens
        self.spec_max_batch = spec_max_batch
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.can_run_more = can_run_more  # the model-wide cap (max_concurrent_batch_size) across pools
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.dropped_ids: list[str] = []  # worker must forget these at the next step
        self.last_step_id = 0
        self.num_preemptions = 0

    # ---- requests in and out -----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queued behind every waiting request of its priority or better."""
        self.requests[request.request_id] = request
        if not self.waiting or self.waiting[-1].priority <= request.priority:
            self.waiting.append(request)
        else:
            self.waiting.insert(next(i for i, r in enumerate(self.waiting) if r.priority > request.priority), request)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._release(request)
        return request

    def preempt_all(self) -> None:
        """Every running request back to waiting, its blocks freed (sleep mode): recomputed later,
        its tokens so far kept. The worker is told to forget them by the next Step's reset."""
        for request in list(self.running):
            self._preempt(request)
        self.take_dropped_ids()

    def take_all(self) -> list[Request]:
        """Empty the scheduler (its worker is gone); returns every request it held."""
        requests = list(self.requests.values())
        for request in requests:
            self.kv.free(request)
        self.requests.clear()
        self.running.clear()
        self.waiting.clear()
        return requests

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.dropped_ids or self.kv.has_transfers)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    # ---- one iteration ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Running rows first (decode, then prompt chunks), then waiting requests join while the
        token budget and max_num_seqs allow; rows of a worse priority may sit the step out (_hold_back)."""
        self.last_step_id += 1
        out = SchedulerOutput(step=Step(step_id=self.last_step_id, new_seqs=[], scheduled=[], dropped_ids=[]))
        budget = self.max_num_batched_tokens
        # decode rows first, then prompt chunks, each bounded while prompts compete for the budget
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens <= 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        can_admit = bool(self.waiting) and len(self.running) < self.max_num_seqs and self.can_run_more()
        share = self.long_prefill_tokens if len(prefilling) + can_admit > 1 else budget
        focus = min([r.priority for r in prefilling] + ([self.waiting[0].priority] if can_admit else []), default=None)
        rows, held = self._hold_back(sorted(decoding + prefilling, key=lambda r: r.priority), focus)
        budget, preempted_any = self._schedule_running(out, rows, budget, share)
        num_new_seqs = len(out.step.new_seqs)
        if not preempted_any:
            budget = self._admit_waiting(out, budget, share, focus)
        if held and len(out.step.new_seqs) == num_new_seqs and not any(
                r.request_id in out.num_new_tokens for r in prefilling if r.priority <= focus):
            budget, _ = self._schedule_running(out, held, budget, share)  # the better prompt could not go
        speculating = self._speculate(out, budget)
        self._look_ahead(out, 1 + self.num_speculative_tokens if speculating else 1)
        out.step.dropped_ids = self.take_dropped_ids()
        self.kv.take_transfers(out.step)
        return out

    @staticmethod
    def _hold_back(rows: list[Request], focus: int | None) -> tuple[list[Request], list[Request]]:
        """Priority: while a prompt of priority `focus` is computed (or can be admitted), rows of a
        worse priority sit the step out, so a batch load does not slow an interactive request's first
        token; they run again as soon as no better prompt is pending, or when it could not go.
        Returns (the rows that go, the rows held); `rows` are sorted best priority first."""
        if focus is None:
            return rows, []
        cut = next((i for i, r in enumerate(rows) if r.priority > focus), len(rows))
        return rows[:cut], rows[cut:]

    def _admit_waiting(self, out: SchedulerOutput, budget: int, share: int, focus: int | None) -> int:
        """Waiting requests join, best priority first, from their longest cached prefix; returns the
        budget left. A request that does not fit stops the queue (no overtaking)."""
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and self.can_run_more() and self._is_batch_open()
               and (focus is None or self.waiting[0].priority <= focus)):
            request = self.waiting[0]
            if not self.has_lora_slot(request):
                break
            hits = self.kv.get_computed_blocks(request)
            num_computed = len(hits) * self.kv.block_size
            num_new = request.fit_images(num_computed, min(request.num_tokens - num_computed, budget, share), budget)
            if num_new == 0 or self.kv.allocate_slots(request, num_new, hits) is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_computed
            first = not request.first_scheduled_at  # not after a preemption, a migration or a handoff
            if first:
                request.num_cached_tokens = num_computed
                request.first_scheduled_at = time.time()
            if not request.is_probe:
                self.kv.record_admission(request.num_tokens, hits, first)
            self._emit(out, request, num_new, [])
            budget -= num_new
        return budget

    def has_lora_slot(self, request: Request) -> bool:
        """A request on an adapter joins while the running batch mixes fewer than max_loras others."""
        if request.lora is None:
            return True
        running = {r.lora for r in self.running if r.lora is not None}
        return request.lora in running or len(running) < self.max_loras

    def _schedule_running(self, out: SchedulerOutput, rows: list[Request], budget: int,
                          share: int) -> tuple[int, bool]:
        """Tokens for running requests, in order; returns the budget left and whether any was preempted."""
        preempted_any = False
        for request in rows:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = request.fit_images(request.num_computed_tokens,
                                         min(request.num_tokens - request.num_computed_tokens, budget, share), budget)
            if num_new == 0:
                continue  # an image larger than this step's budget left: a later step
            new_blocks = self._allocate_or_preempt(request, num_new)
            if new_blocks is None:
                preempted_any = True
                continue
            self._emit(out, request, num_new, [b.block_id for b in new_blocks])
            budget -= num_new
        return budget, preempted_any

    def _speculate(self, out: SchedulerOutput, budget: int) -> bool:
        """Speculative decoding: each decode row gets slots for up to num_speculative_tokens draft
        tokens past its one, while the token budget lasts, which the worker fills with its proposer's
        drafts and verifies in this step's forward; a row whose slots would need a block that is not
        free goes without (lookahead never preempts). Off for a step of more than spec_max_batch
        running requests, where verifying drafts costs more than it saves. Returns whether it is on
        (a multi-step Step then speculates in each of its iterations)."""
        if not self.num_speculative_tokens or len(self.running) > self.spec_max_batch:
            return False  # multi-step may take the step instead
        for row in out.step.scheduled:
            request = self.requests[row.request_id]
            if budget <= 0:
                break
            if row.num_new_tokens != 1 or request.num_tokens - request.num_computed_tokens != 1:
                continue  # a prompt chunk
            room = min(self.num_speculative_tokens, budget,
                       request.sampling.max_tokens - len(request.output_token_ids) - 1)
            more = self.kv.allocate_slots(request, 1 + room) if room > 0 else None
            if more is None:
                continue
            row.new_block_ids.extend(b.block_id for b in more)
            row.num_lookahead = room
            budget -= room
        return True

    def _look_ahead(self, out: SchedulerOutput, tokens_per_iteration: int = 1) -> None:
        """Multi-step: a batch of decode rows with nothing waiting runs up to num_scheduler_steps
        iterations in one Step, which saves the round trip between them. Only then, because a request
        arriving meanwhile waits for the Step to end. A row gets slots for tokens_per_iteration tokens
        an iteration (1 + its drafts' where it speculates), up to its max_tokens only (the worker ends
        it there, and drafts only into the slots it has)."""
        rows = out.step.scheduled
        if self.num_scheduler_steps == 1 or self.waiting or out.step.new_seqs or not rows:
            return
        if any(row.num_new_tokens != 1 for row in rows):
            return
        requests = [self.requests[row.request_id] for row in rows]
        remaining = [r.sampling.max_tokens - len(r.output_token_ids) for r in requests]
        num_steps = min(self.num_scheduler_steps, max(remaining))
        if num_steps < 2:
            return
        for row, request, left in zip(rows, requests, remaining, strict=True):
            more = self.kv.allocate_slots(request, min(num_steps * tokens_per_iteration, left))
            if more is None:
                return  # one iteration (blocks already added to earlier rows stay theirs, listed below)
            row.new_block_ids.extend(b.block_id for b in more)
        out.step.num_steps = num_steps

    def _is_batch_open(self) -> bool:
        """Whether waiting requests may join the running batch (always here; StaticScheduler's differs)."""
        return True

    def _allocate_or_preempt(self, request: Request, num_new: int):
        while True:
            new_blocks = self.kv.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            victim = max(reversed(self.running), key=lambda r: r.priority)  # the youngest of the worst
            self._preempt(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        # first of its priority: it was admitted before every waiting request of that priority
        at = next((i for i, r in enumerate(self.waiting) if r.priority >= request.priority), len(self.waiting))
        self.waiting.insert(at, request)

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        if request.is_on_worker:
            self.dropped_ids.append(request.request_id)
            request.is_on_worker = False

    def _emit(self, out: SchedulerOutput, request: Request, num_new: int, new_block_ids: list[int]) -> None:
        out.num_new_tokens[request.request_id] = num_new
        if request.is_on_worker:
            out.step.scheduled.append(ScheduledSeq(request.request_id, num_new, request.num_computed_tokens,
                                                   new_block_ids))
            return
        request.is_on_worker = True
        out.step.new_seqs.append(NewSeq(
            request_id=request.request_id, token_ids=request.all_token_ids,
            num_prompt_tokens=request.num_prompt_tokens, num_computed_tokens=request.num_computed_tokens,
            num_new_tokens=num_new, block_ids=self.kv.block_ids(request.request_id),
            sampling=request.sampling, reply_to=request.reply_to,
            num_cached_tokens=request.num_cached_tokens, first_scheduled_at=request.first_scheduled_at,
            lora=request.lora, images=request.images,
        ))

    def take_dropped_ids(self) -> list[str]:
        ids, self.dropped_ids = self.dropped_ids, []
        return ids

    # ---- results --------------------------------------------------------------------------------

    def update(self, out: SchedulerOutput, result: StepResult) -> list[FinishedRequest]:
        # a multi-step Step computed one more token per extra iteration of each row, and a row that
        # speculated one more per draft token accepted
        num_sampled = Counter(s.request_id for s in result.sampled)
        for request_id, num_new in out.num_new_tokens.items():
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.num_computed_tokens += num_new + max(num_sampled.get(request_id, 1) - 1, 0)
        finished = []
        for sampled in result.sampled:
            request = self.requests.get(sampled.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if sampled.error is None and sampled.token_id >= 0:  # -1 without an error: a pooling row's embedding
                request.output_token_ids.append(sampled.token_id)
            if sampled.finish_reason is not None:
                request.is_on_worker = False  # the worker dropped it itself
                self.running.remove(request)
                self.requests.pop(request.request_id)
                request.status = RequestStatus.FINISHED
                self.kv.free(request)
                finished.append(FinishedRequest(request, sampled.finish_reason, sampled.error))
        return finished
