"""Sizing the KV pool on a GPU: gpu_memory_utilization of the device, less the weights, a profiled
activation peak, and what the process holds outside torch's allocator (CUDA context, cuBLAS)."""

from __future__ import annotations

import torch

from services.worker.backends.cuda.inputs import CudaMeta
from services.worker.backends.kv_pool import KVSpec
from shared.config import ConfigError


@torch.inference_mode()
def profile_peak(model: torch.nn.Module, kv: KVSpec, num_tokens: int, device: torch.device) -> int:
    """Bytes allocated at the peak of a prefill of `num_tokens` (the largest step), weights included."""
    num_blocks = -(-num_tokens // kv.block_size)
    caches = kv.allocate(num_blocks, device)
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    positions = torch.arange(num_tokens, device=device)
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    meta = CudaMeta(slot_mapping=positions, decode_rows=empty, decode_tables=empty.view(0, 0), decode_lens=empty,
                    num_splits=1, prefill_starts=torch.zeros(1, dtype=torch.int32, device=device),
                    prefill_lens=torch.full((1,), num_tokens, dtype=torch.int32, device=device),
                    prefill_cached=torch.zeros(1, dtype=torch.int32, device=device),
                    prefill_tables=torch.arange(num_blocks, dtype=torch.int32, device=device).view(1, -1),
                    max_query_len=num_tokens, max_decode_len=0)
    model.compute_logits(model(ids, positions, caches, meta)[-1:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del caches
    return peak - kv.bytes_per_block * (num_blocks + 1)  # the profile's own small pool is not activations


def kv_budget(utilization: float, peak: int, device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)
    budget = int(utilization * total) - peak - outside_torch
    if budget <= 0:
        raise ConfigError(f"gpu_memory_utilization {utilization} of {total / 2**30:.1f} GiB leaves no room for a KV "
                          f"cache after {peak / 2**30:.2f} GiB of weights and activations: raise it or use a smaller "
                          "model")
    return budget
