"""The host KV tier's memory: a shared-memory file of block-sized slots that every worker of a model
on this host maps; the scheduler decides what goes where, the worker only copies (Step.kv_saves/loads)."""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shared.checks import ConfigError
from shared.log import get_logger
from shared.wire.kv_events import HostTierInfo

if TYPE_CHECKING:
    from services.worker.backends.cuda.tier_copies import PinnedTierCopies
    from services.worker.kv_disk import DiskTier

log = get_logger("worker.kv_tier")
HEADER_BYTES = 4096  # the tier's identity (a uuid) and room to grow; slots start after it
SHM_DIR = Path("/dev/shm")


def block_bytes(tensors: list[torch.Tensor]) -> list[int]:
    """What one block is in each tensor indexed by block (dim 0), in bytes."""
    return [t[0].numel() * t.element_size() for t in tensors]


def slot_layout(tensors: list[torch.Tensor]) -> str:
    """What a slot holds, as a digest: tiers of one layout (on other hosts) copy slots between them."""
    return hashlib.sha256(repr([(tuple(t.shape[1:]), str(t.dtype)) for t in tensors]).encode()).hexdigest()[:16]


def tier_name(scope: str, tensors: list[torch.Tensor]) -> str:
    """Workers of one scope (a model on one bus: one scheduler indexes it) with one KV layout share a
    tier; another stack on the host, another model or layout gets a file of its own."""
    return "switchyard-kv-" + hashlib.sha256(f"{scope} {slot_layout(tensors)}".encode()).hexdigest()[:16]


class HostTier:
    def __init__(self, path: Path, num_slots: int, slot_bytes: int, tier_id: str, fd: int, mapped: mmap.mmap,
                 layout: str = ""):
        self.path = path
        self.layout = layout
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.tier_id = tier_id  # a new file is a new tier: the scheduler never reads one it did not fill
        self._fd = fd
        self._mmap = mapped
        buffer = torch.frombuffer(mapped, dtype=torch.uint8, offset=HEADER_BYTES, count=num_slots * slot_bytes)
        self.slots = buffer.view(num_slots, slot_bytes)
        self.disk: DiskTier | None = None  # its spill on a local disk (kv_disk.py), when asked for
        self.copies: PinnedTierCopies | None = None  # a GPU's asynchronous copies (backends/cuda/tier_copies.py)

    @classmethod
    def open(cls, scope: str, tensors: list[torch.Tensor], size_gib: float, directory: Path | None = None) -> HostTier:
        """Maps the scope's tier on this host, created with size_gib of slots (its memory reserved) if
        no worker has it; one that exists keeps its size, so that every worker mapping it has every
        slot the scheduler hands out. Each worker holds a shared lock; the last to leave removes it."""
        slot_bytes = sum(block_bytes(tensors))
        wanted = int(size_gib * 2**30) // slot_bytes
        if wanted < 1:
            raise ConfigError(f"--kv-offloading-size {size_gib} GiB holds no KV block of this model "
                              f"({slot_bytes / 2**20:.2f} MiB each)")
        directory = directory or (SHM_DIR if SHM_DIR.is_dir() else Path(os.environ.get("TMPDIR", "/tmp")))
        path = directory / tier_name(scope, tensors)
        sweep(directory, keep=path)  # its own, a worker killed and restarted maps again: the same tier
        with setup_lock(path):  # one worker at a time creates or removes the file
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                size = HEADER_BYTES + wanted * slot_bytes
                if os.fstat(fd).st_size >= HEADER_BYTES + slot_bytes:  # a peer made it: its size is the tier's
                    size = os.fstat(fd).st_size
                else:
                    try:  # reserved now, so that a full /dev/shm fails here and not as a SIGBUS mid-step
                        os.posix_fallocate(fd, 0, size)
                    except OSError as exc:
                        raise ConfigError(
                            f"--kv-offloading-size: could not reserve {size / 2**30:.2f} GiB in {directory} "
                            f"({exc.strerror}); give the host (or the container's /dev/shm) more shared memory "
                            "or ask for less") from None
                size = os.fstat(fd).st_size
                mapped = mmap.mmap(fd, size)
                tier_id = bytes(mapped[:32]).rstrip(b"\0").decode()
                if not tier_id:
                    tier_id = uuid.uuid4().hex
                    mapped[:32] = tier_id.encode().ljust(32, b"\0")
                fcntl.flock(fd, fcntl.LOCK_SH)  # held while this worker maps it
            except BaseException:
                os.close(fd)
                raise
        tier = cls(path, (size - HEADER_BYTES) // slot_bytes, slot_bytes, tier_id, fd, mapped, slot_layout(tensors))
        if tensors[0].is_cuda:
            from services.worker.backends.cuda.tier_copies import PinnedTierCopies

            tier.copies = PinnedTierCopies.register(tier.slots, tensors[0].device)
        log.info("kv_tier_mapped", path=str(path), tier_id=tier_id, num_slots=tier.num_slots,
                 gib=round(tier.num_slots * slot_bytes / 2**30, 3), pinned=tier.copies is not None)
        return tier

    def info(self) -> HostTierInfo:
        return HostTierInfo(tier_id=self.tier_id, num_slots=self.num_slots, path=str(self.path), layout=self.layout,
                            slot_bytes=self.slot_bytes, disk_slots=self.disk.num_slots if self.disk else 0)

    def slot_view(self, slot: int) -> memoryview:
        start = HEADER_BYTES + slot * self.slot_bytes
        return memoryview(self._mmap)[start:start + self.slot_bytes]

    def read(self, slot: int, offset: int, length: int) -> bytes:
        """Bytes of one slot, for another host's worker (the scheduler pins the slot meanwhile)."""
        if not (0 <= slot < self.num_slots and 0 <= offset and 0 < length and offset + length <= self.slot_bytes):
            raise ValueError(f"slot {slot} [{offset}, {offset + length}) is outside the tier")
        start = HEADER_BYTES + slot * self.slot_bytes + offset
        return self._mmap[start:start + length]

    def write(self, slot: int, offset: int, data: bytes) -> None:
        """Bytes into one of our slots, from another host's tier (the scheduler holds it pending meanwhile)."""
        if not (0 <= slot < self.num_slots and 0 <= offset and offset + len(data) <= self.slot_bytes):
            raise ValueError(f"slot {slot} [{offset}, {offset + len(data)}) is outside the tier")
        start = HEADER_BYTES + slot * self.slot_bytes + offset
        self._mmap[start:start + len(data)] = data

    def transfer(self, tensors: list[torch.Tensor], saves: list[tuple[int, int]], loads: list[tuple[int, int]],
                 spills: list[tuple[int, int]] = (), disk_loads: list[tuple[int, int]] = ()) -> None:
        """Spills (slot -> disk) first: the saves reuse their slots; saves (pool block -> slot) next: a
        block they read may be the target of a load; loads from the tier, then from the disk."""
        if (spills or disk_loads) and self.disk is None:
            raise RuntimeError("the Step moves KV blocks to or from a disk spill this worker does not have")
        if spills:
            self.disk.spill(self, spills)
        if saves:
            blocks, slots = _columns(saves, len(tensors[0]), self.num_slots)
            if self.copies is not None:
                self.copies.save(tensors, blocks.tolist(), slots.tolist())
            else:
                offset = 0
                for t in tensors:
                    rows = as_rows(t)
                    self.slots[slots, offset:offset + rows.shape[1]] = rows[blocks].cpu()
                    offset += rows.shape[1]
        if loads:
            slots, blocks = _columns(loads, self.num_slots, len(tensors[0]))
            if self.copies is not None:
                self.copies.load(tensors, slots.tolist(), blocks.tolist())
            else:
                offset = 0
                for t in tensors:
                    rows = as_rows(t)
                    rows[blocks] = self.slots[slots, offset:offset + rows.shape[1]].to(t.device)
                    offset += rows.shape[1]
        if disk_loads:
            self.disk.load(tensors, disk_loads)

    def settle(self) -> None:
        """The copies transfer() started have landed (a GPU's run beside the forward): called before
        the Step is answered."""
        if self.copies is not None:
            self.copies.settle()

    def close(self) -> None:
        """Unmaps; removes the file (and its disk spill's) when no other worker holds it."""
        if self.copies is not None:
            self.copies.close()
            self.copies = None  # its view of the slots too: the mapping closes with none left
        if self.disk is not None:
            self.disk.close()
        del self.slots
        self._mmap.close()
        with setup_lock(self.path):
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.path.unlink(missing_ok=True)
            except BlockingIOError:
                pass  # another worker of the model still maps it
            finally:
                os.close(self._fd)


def sweep(directory: Path, keep: Path | None = None) -> list[Path]:
    """Removes the tiers no worker maps (their workers were killed), but `keep`: shared memory is
    the host's RAM, and a tier of a stack that is gone would hold it until a reboot. Returns what
    it removed."""
    removed = []
    for path in directory.glob("switchyard-kv-*"):
        if path == keep:
            continue
        with setup_lock(path):
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                path.unlink(missing_ok=True)
                removed.append(path)
            except BlockingIOError:
                pass  # mapped by a live worker
            finally:
                os.close(fd)
    return removed


@contextmanager
def setup_lock(path: Path) -> Iterator[None]:
    """One for the directory's tiers (never removed, so every process locks the same file)."""
    fd = os.open(path.parent / "switchyard-kv.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """[blocks, ...] of any dtype as [blocks, bytes per block] of uint8, sharing its storage."""
    return t.view(torch.uint8).view(t.shape[0], -1)


def _columns(pairs: list[tuple[int, int]], first_bound: int, second_bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    first = torch.tensor([a for a, _ in pairs], dtype=torch.long)
    second = torch.tensor([b for _, b in pairs], dtype=torch.long)
    if first.min() < 0 or first.max() >= first_bound or second.min() < 0 or second.max() >= second_bound:
        raise ValueError(f"a KV transfer names a block or slot out of range: {pairs}")
    return first, second
