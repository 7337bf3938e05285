"""The paged KV pool: per layer, K and V as [num_blocks, num_kv_heads, block_size, head_dim]
(head-major within a block, so gathered blocks feed matmuls without a transposed copy)."""

from __future__ import annotations

import torch

from services.worker.model_config import ModelConfig
from shared.config import ConfigError

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_dtype_for(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if kv_cache_dtype == "auto" else KV_DTYPES[kv_cache_dtype]


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * element


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    return budget_bytes // bytes_per_block(cfg, block_size, dtype)


def check_capacity(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                   max_model_len: int) -> None:
    """One sequence of max_model_len must fit in the pool, or a long request could never finish."""
    if num_blocks * block_size >= max_model_len:
        return
    need_gib = -(-max_model_len // block_size) * bytes_per_block(cfg, block_size, dtype) / 2**30
    raise ConfigError(
        f"the KV cache holds {num_blocks * block_size} tokens ({num_blocks} blocks of {block_size}), fewer than "
        f"max_model_len {max_model_len}: give it at least {need_gib:.2f} GiB (--kv-cache-memory-gib) "
        f"or lower --max-model-len")


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int,
                      dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_layers)]
