"""The host KV tier's spill on a local disk: a file of the tier's slots that the blocks its LRU drops
are written to (Step.kv_spills), read back straight into the pool on a prefix hit (Step.kv_disk_loads)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import torch

from services.worker.kv_tier import HostTier, as_rows, setup_lock, sweep
from shared.checks import ConfigError
from shared.log import get_logger

log = get_logger("worker.kv_disk")
DEFAULT_DIR = Path("/var/tmp")  # disk, where /tmp may be memory


class DiskTier:
    def __init__(self, path: Path, num_slots: int, slot_bytes: int, fd: int):
        self.path = path
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._fd = fd

    @classmethod
    def open(cls, tier: HostTier, size_gib: float, directory: Path | None = None) -> DiskTier:
        """The spill of `tier` on this host, created with size_gib of slots if no worker has it (one
        that exists keeps its size); shared and removed as the tier's own file is."""
        directory = directory or DEFAULT_DIR
        num_slots = int(size_gib * 2**30) // tier.slot_bytes
        if num_slots < 1:
            raise ConfigError(f"--kv-offloading-disk-size {size_gib} GiB holds no KV block of this model "
                              f"({tier.slot_bytes / 2**20:.2f} MiB each)")
        path = directory / f"{tier.path.name}.disk"
        sweep(directory, keep=path)
        with setup_lock(path):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                size = os.fstat(fd).st_size
                if size < tier.slot_bytes:  # new: reserved now, so a full disk fails here, not mid-step
                    size = num_slots * tier.slot_bytes
                    try:
                        os.posix_fallocate(fd, 0, size)
                    except OSError as exc:
                        raise ConfigError(f"--kv-offloading-disk-size: could not reserve {size / 2**30:.2f} GiB in "
                                          f"{directory} ({exc.strerror}); free the disk or ask for less") from None
                fcntl.flock(fd, fcntl.LOCK_SH)
            except BaseException:
                os.close(fd)
                raise
        disk = cls(path, size // tier.slot_bytes, tier.slot_bytes, fd)
        log.info("kv_disk_opened", path=str(path), num_slots=disk.num_slots, gib=round(size / 2**30, 3))
        return disk

    def spill(self, tier: HostTier, pairs: list[tuple[int, int]]) -> None:
        """(tier slot, disk slot): the slots' bytes written to the disk, before the Step's saves reuse them."""
        for slot, disk_slot in pairs:
            self._check(disk_slot)
            os.pwrite(self._fd, tier.slot_view(slot), disk_slot * self.slot_bytes)

    def load(self, tensors: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """(disk slot, pool block): the slots read into the pool's blocks (every tensor's share of a slot)."""
        staging = torch.empty(len(pairs), self.slot_bytes, dtype=torch.uint8)
        for i, (disk_slot, _) in enumerate(pairs):
            self._check(disk_slot)
            if os.preadv(self._fd, [memoryview(staging[i].numpy())], disk_slot * self.slot_bytes) != self.slot_bytes:
                raise OSError(f"the KV disk spill {self.path} is shorter than its slot {disk_slot}")
        blocks = torch.tensor([block for _, block in pairs], dtype=torch.long)
        offset = 0
        for t in tensors:
            rows = as_rows(t)
            rows[blocks] = staging[:, offset:offset + rows.shape[1]].to(t.device)
            offset += rows.shape[1]

    def _check(self, disk_slot: int) -> None:
        if not 0 <= disk_slot < self.num_slots:
            raise ValueError(f"disk slot {disk_slot} is outside the KV disk spill ({self.num_slots} slots)")

    def close(self) -> None:
        """Removes the file when no other worker holds it."""
        with setup_lock(self.path):
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.path.unlink(missing_ok=True)
            except BlockingIOError:
                pass
            finally:
                os.close(self._fd)
