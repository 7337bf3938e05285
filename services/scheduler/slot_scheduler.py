"""Steps for a static-shape (slots) worker: a prefill chunk at batch 1, or a decode over the slots.

The worker's program has two shapes only (QAIC: `prefill_seq_len` tokens of one sequence, or one
token for each of `full_batch_size` slots), so a step is one or the other, never a mix. A free
slot is refilled by prefilling the next waiting request into it, chunk by chunk; while a prompt is
being prefilled, decode steps alternate with its chunks, so the running sequences slow down by one
chunk at a time and never stall behind a long prompt.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler import Scheduler, SchedulerOutput, _always
from services.scheduler.slot_manager import SlotManager
from shared.wire.messages import Step


class SlotScheduler(Scheduler):
    kv: SlotManager

    def __init__(self, slots: SlotManager, prefill_seq_len: int, can_run_more: Callable[[], bool] = _always,
                 num_scheduler_steps: int = 1):
        super().__init__(slots, slots.num_slots, prefill_seq_len, can_run_more,
                         num_scheduler_steps=num_scheduler_steps)
        self.prefill_seq_len = prefill_seq_len
        self.last_was_prefill = False

    def schedule(self) -> SchedulerOutput:
        self.last_step_id += 1
        out = SchedulerOutput(step=Step(step_id=self.last_step_id, new_seqs=[], scheduled=[], dropped_ids=[]))
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        can_admit = bool(self.waiting) and self.kv.has_free_slot and self.can_run_more()
        if (prefilling or can_admit) and not (decoding and self.last_was_prefill):
            request = prefilling[0] if prefilling else self._admit()
            self._emit(out, request, min(request.num_tokens - request.num_computed_tokens, self.prefill_seq_len), [])
            self.last_was_prefill = True
        elif decoding:
            for request in decoding:
                self._emit(out, request, 1, [])
            self.last_was_prefill = False
            if not prefilling:
                self._look_ahead(out)
        out.step.dropped_ids = self.take_dropped_ids()
        return out

    def _admit(self) -> Request:
        request = self.waiting.popleft()
        self.kv.allocate_slots(request, 0)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.first_scheduled_at = time.time()
        self.kv.record_admission(request.num_tokens, [], True)
        return request
