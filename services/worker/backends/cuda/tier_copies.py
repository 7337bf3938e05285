"""The host KV tier's copies on a GPU: the tier's shared memory registered with CUDA (pinned), saves
copied out on a stream of their own beside the step's forward, loads copied in ahead of it."""

from __future__ import annotations

import torch

from services.worker.kv_tier import as_rows
from shared.log import get_logger

log = get_logger("worker.cuda.tier")


class PinnedTierCopies:
    """Slots are [num_slots, slot_bytes] of uint8 in the tier's mapping; a slot holds one block of each
    KV tensor side by side. A Step's saves are gathered on the device into one staging buffer (on the
    compute stream, so before anything the forward writes), then copied to their slots by DMA on the
    copy stream while the forward runs; settle() waits for them before the Step is answered (a slot
    saved is readable once its Step is back). Loads are copied into a staging buffer and scattered
    into the pool on the compute stream: the host goes on, the forward follows them."""

    def __init__(self, slots: torch.Tensor, device: torch.device):
        self.slots = slots
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._pending: list[torch.cuda.Event] = []

    @classmethod
    def register(cls, slots: torch.Tensor, device: torch.device) -> PinnedTierCopies | None:
        """None where CUDA cannot pin the mapping (a file on a disk's file system rather than in shared
        memory, a memlock limit): the tier then copies through pageable memory, synchronously."""
        cudart = torch.cuda.cudart()
        error = int(cudart.cudaHostRegister(slots.data_ptr(), slots.numel(), 0))
        if error:
            cudart.cudaGetLastError()  # else the next kernel launch reports it as its own
            log.warning("kv_tier_not_pinned", error=error, bytes=slots.numel(),
                        remedy="keep --kv-offloading-dir in shared memory (tmpfs, /dev/shm by default) and the "
                               "memlock limit (ulimit -l) above the tier's size for asynchronous copies")
            return None
        return cls(slots, device)

    def save(self, tensors: list[torch.Tensor], blocks: list[int], slots: list[int]) -> None:
        blocks, slots = _by_slot(blocks, slots)
        index = torch.tensor(blocks, device=self.device)
        staging = torch.cat([as_rows(t).index_select(0, index) for t in tensors], dim=1)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for first, slot, n in _runs(slots):
                self.slots[slot:slot + n].copy_(staging[first:first + n], non_blocking=True)
            staging.record_stream(self.stream)  # kept by the allocator until the copies are done
            done = torch.cuda.Event()
            done.record(self.stream)
        self._pending.append(done)

    def load(self, tensors: list[torch.Tensor], slots: list[int], blocks: list[int]) -> None:
        blocks, slots = _by_slot(blocks, slots)
        staging = torch.empty(len(slots), self.slots.shape[1], dtype=torch.uint8, device=self.device)
        for first, slot, n in _runs(slots):
            staging[first:first + n].copy_(self.slots[slot:slot + n], non_blocking=True)
        index = torch.tensor(blocks, device=self.device)
        offset = 0
        for t in tensors:
            rows = as_rows(t)
            rows.index_copy_(0, index, staging[:, offset:offset + rows.shape[1]])
            offset += rows.shape[1]
        done = torch.cuda.Event()  # the slots it read stay pinned until the Step is answered
        done.record(torch.cuda.current_stream(self.device))
        self._pending.append(done)

    def settle(self) -> None:
        """Every copy started has landed: the saved slots hold their blocks, the loaded ones are read."""
        for done in self._pending:
            done.synchronize()
        self._pending.clear()

    def close(self) -> None:
        self.settle()
        torch.cuda.cudart().cudaHostUnregister(self.slots.data_ptr())


def _by_slot(blocks: list[int], slots: list[int]) -> tuple[list[int], list[int]]:
    """The pairs in the order of their slots: consecutive slots become one copy."""
    pairs = sorted(zip(slots, blocks, strict=True))
    return [b for _, b in pairs], [s for s, _ in pairs]


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first index, first slot, count) of each run of consecutive slots in a sorted list."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first, start, n = runs[-1]
            runs[-1] = (first, start, n + 1)
        else:
            runs.append((i, slot, 1))
    return runs
