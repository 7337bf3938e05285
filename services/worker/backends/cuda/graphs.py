"""CUDA graphs for decode-only steps: one graph per padded batch size, captured at start-up.

A decode step is ~10 small kernels per layer; launching them from Python costs more than running
them at small batches. Each graph runs the whole forward over static buffers: a step of B rows
takes the graph of the smallest captured size >= B, its rows copied in and the rest padded (slot
-1: nothing written; the null block as context, length 1). A step whose longest context exceeds
`max_seq_len_to_capture` (the width of the captured block tables) or whose batch is larger than
the largest graph runs eagerly.
"""

from __future__ import annotations

import torch

from services.worker.backends.cuda.inputs import CudaInputs, CudaMeta
from services.worker.backends.cuda.kernels.decode_attention import num_splits_for
from shared.log import get_logger

log = get_logger("worker.cuda")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to max_num_seqs (vLLM's choice)."""
    sizes = [b for b in (1, 2, 4) if b <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches, block_size: int, null_block: int, max_num_seqs: int,
                 max_seq_len_to_capture: int, num_kv_heads: int, num_sms: int):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_seq_len_to_capture = max_seq_len_to_capture
        self.width = -(-max_seq_len_to_capture // block_size)
        self.sizes = capture_sizes(max_num_seqs)
        device = kv_caches[0][0].device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.tables = torch.full((n, self.width), null_block, dtype=torch.int32, device=device)
        self.lens = torch.ones(n, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, dtype=torch.int32, device=device)
        self.null_block = null_block
        self.num_kv_heads, self.num_sms = num_kv_heads, num_sms
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, size: int) -> CudaMeta:
        empty = self.lens[:0]
        return CudaMeta(slot_mapping=self.slots[:size], decode_rows=self.rows[:size], decode_tables=self.tables[:size],
                        decode_lens=self.lens[:size],
                        num_splits=num_splits_for(self.max_seq_len_to_capture, self.block_size, size,
                                                  self.num_kv_heads, self.num_sms),
                        prefill_starts=empty, prefill_lens=empty, prefill_cached=empty,
                        prefill_tables=self.tables[:0], max_query_len=0, max_decode_len=self.max_seq_len_to_capture)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, so the smaller graphs reuse the memory pool of the largest."""
        for size in reversed(self.sizes):
            meta = self._meta(size)
            args = (self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
            for _ in range(2):  # warm up: Triton compiles, the allocator settles
                self.model(*args)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self.model(*args)
            self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        log.info("cuda_graphs_captured", sizes=self.sizes, max_seq_len_to_capture=self.max_seq_len_to_capture)

    def can_run(self, inputs: CudaInputs) -> bool:
        meta = inputs.meta
        lora = getattr(self.model, "lora", None)  # a step with adapter rows runs eagerly: the graphs hold the base alone
        return (bool(self.graphs) and meta.is_decode_only and (lora is None or lora.rows is None) and inputs.input_ids.shape[0] <= self.sizes[-1]
                and meta.max_decode_len <= self.max_seq_len_to_capture)

    def run(self, inputs: CudaInputs) -> torch.Tensor:
        meta = inputs.meta
        num_rows = inputs.input_ids.shape[0]
        size = next(s for s in self.sizes if s >= num_rows)
        self.input_ids[:num_rows].copy_(inputs.input_ids)
        self.positions[:num_rows].copy_(inputs.positions)
        self.slots[:num_rows].copy_(meta.slot_mapping)
        self.slots[num_rows:size].fill_(-1)
        self.tables[:num_rows].fill_(self.null_block)
        self.tables[:num_rows, : meta.decode_tables.shape[1]].copy_(meta.decode_tables)
        self.tables[num_rows:size].fill_(self.null_block)
        self.lens[:num_rows].copy_(meta.decode_lens)
        self.lens[num_rows:size].fill_(1)
        self.graphs[size].replay()
        return self.outputs[size][:num_rows]
