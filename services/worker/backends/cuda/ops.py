"""The CUDA backend's layer ops: our Triton kernels (kernels/), the GEMMs stay torch's."""

from __future__ import annotations

import torch

from services.worker.backends.cuda.inputs import CudaMeta
from services.worker.backends.cuda.kernels.activation import silu_and_mul
from services.worker.backends.cuda.kernels.decode_attention import decode_attention
from services.worker.backends.cuda.kernels.experts import grouped_experts
from services.worker.backends.cuda.kernels.kv_write import write_kv
from services.worker.backends.cuda.kernels.lora import lora_add
from services.worker.backends.cuda.kernels.norm import rms_norm
from services.worker.backends.cuda.kernels.prefill_attention import prefill_attention
from services.worker.backends.cuda.kernels.rotary import rotary


class TritonOps:
    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0):
        self.k_scale, self.v_scale = k_scale, v_scale  # fp8 KV: stored / scale, read * scale

    def attention(self, q, k, v, kv_cache, meta: CudaMeta, scale: float, window: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        out = torch.empty_like(q)
        decode_attention(q, k_cache, v_cache, out, meta.decode_rows, meta.decode_tables, meta.decode_lens, scale,
                         meta.num_splits, self.k_scale, self.v_scale, window, softcap)
        prefill_attention(q, k_cache, v_cache, out, meta.prefill_starts, meta.prefill_lens, meta.prefill_cached,
                          meta.prefill_tables, meta.max_query_len, scale, self.k_scale, self.v_scale, window,
                          softcap, meta.prefill_limits)
        return out

    def add_rms_norm(self, x, residual, weight, eps):
        return rms_norm(x, weight, eps, residual=residual), residual  # the kernel sums into residual in place

    def rms_norm(self, x, weight, eps):
        return rms_norm(x, weight, eps)

    def rotary(self, q, k, cos, sin):
        return rotary(q, k, cos, sin)

    def silu_and_mul(self, gate_up):
        return silu_and_mul(gate_up)

    def routed_experts(self, x, w13, w2, weights, experts):
        return grouped_experts(x, w13, w2, weights, experts)

    def lora_add(self, x, y, a, b, rows, out_sizes):
        return lora_add(x, y, a, b, rows)
