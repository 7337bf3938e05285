"""The CPU worker's weights moved into memory the kernel may back with 2 MiB pages (transparent huge
pages), so that a decode step's stream through them walks fewer pages."""

from __future__ import annotations

import mmap
from collections.abc import Callable

import torch
from torch import nn

HUGE_PAGE = 2 * 2**20


def move_to_huge_pages(model: nn.Module, then: Callable[[], object] = lambda: None) -> int:
    """Every parameter and buffer of the model that holds at least one huge page's bytes, a whole
    storage of its own, copied into an anonymous mapping advised MADV_HUGEPAGE (tied weights stay
    one tensor); returns the bytes moved. `then` runs before the first copy and after each (the
    worker returns the heap's freed pages to the OS). Where the host's THP mode is `never`, the
    advice does nothing and the copies are plain pages, as before."""
    moved: dict[int, torch.Tensor] = {}  # by the original's storage: a tied weight moves once
    then()
    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if t is None or not _movable(t):
                    continue
                key = t.untyped_storage().data_ptr()
                if key not in moved:
                    copy = huge_page_copy(t.detach())
                    moved[key] = nn.Parameter(copy, requires_grad=False) if isinstance(t, nn.Parameter) else copy
                tensors[name] = moved[key]
                del t
                then()
    return sum(t.nbytes for t in moved.values())


def huge_page_copy(t: torch.Tensor) -> torch.Tensor:
    """t in a mapping of its own (unmapped with the copy's storage) that starts on a huge page, its
    whole huge pages advised MADV_HUGEPAGE; the tail past the last one stays in small pages, so the
    copy is resident in t's bytes and no more."""
    pages = mmap.mmap(-1, t.nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(pages, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    whole = t.nbytes // HUGE_PAGE * HUGE_PAGE
    if whole and hasattr(mmap, "MADV_HUGEPAGE"):
        pages.madvise(mmap.MADV_HUGEPAGE, start, whole)
    copy = raw[start:start + t.nbytes].view(t.dtype).view(t.shape)
    copy.copy_(t)
    return copy


def _movable(t: torch.Tensor) -> bool:
    """A plain host tensor (not oneDNN's opaque packed weights) that is its storage's whole."""
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn and t.is_contiguous()
            and t.nbytes >= HUGE_PAGE and t.untyped_storage().nbytes() == t.nbytes)
