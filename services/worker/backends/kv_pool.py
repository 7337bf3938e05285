"""The paged KV pool every paged backend uses: per layer, K and V as
`[num_blocks + 1, num_kv_heads, block_size, head_dim]`, head-major within a block.

The last block is the null block: it is never announced to the scheduler, so never handed out;
padded rows of a batch (block-table padding, padded decode slots under CUDA graphs) point there,
and their writes land where nothing reads.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from services.worker.model_config import ModelConfig
from shared.config import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # weights' and KV's


def kv_dtype_for(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if kv_cache_dtype == "auto" else DTYPES[kv_cache_dtype]


@dataclass(frozen=True)
class KVSpec:
    """The pool's geometry: what the worker owns and announces, and the scheduler takes as given."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def of(cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> KVSpec:
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def num_blocks_for_budget(self, budget_bytes: int, extra_per_block: int = 0) -> int:
        """Blocks the scheduler may hand out; the null block comes on top of the budget's.
        extra_per_block: what else each block holds (a draft model's KV)."""
        return max(budget_bytes // (self.bytes_per_block + extra_per_block) - 1, 0)

    def check_capacity(self, num_blocks: int, max_model_len: int, extra_per_block: int = 0) -> None:
        """One sequence of max_model_len must fit in the pool, or a long request could never finish."""
        if num_blocks * self.block_size >= max_model_len:
            return
        need_gib = (-(-max_model_len // self.block_size) + 1) * (self.bytes_per_block + extra_per_block) / 2**30
        raise ConfigError(
            f"the KV cache holds {num_blocks * self.block_size} tokens ({num_blocks} blocks of {self.block_size}), "
            f"fewer than max_model_len {max_model_len}: give it at least {need_gib:.2f} GiB "
            f"(--kv-cache-memory-gib) or lower --max-model-len")

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu",
                 storage_dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """num_blocks usable blocks plus the null block (index `num_blocks`), zeroed."""
        shape = (num_blocks + 1, self.num_kv_heads, self.block_size, self.head_dim)
        dtype = storage_dtype or self.dtype
        return [(zeros(shape, dtype, device), zeros(shape, dtype, device)) for _ in range(self.num_layers)]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed tensor. In host memory it lies in an anonymous shared mapping, whose pages the kernel
    zeroes at their first touch: a pool of many GiB starts at once and becomes resident as its blocks
    are first written (torch.zeros writes every page at start; docs/benchmarks.md has the cost). Shared,
    so /proc counts it apart from the heap (RssShmem): a leak check reads the rest (bench/memory.py)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)  # unmapped with the tensor's storage
    return torch.frombuffer(pages, dtype=dtype).view(shape)


def null_block(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """The reserved block's id: the pool's last."""
    return kv_caches[0][0].shape[0] - 1
