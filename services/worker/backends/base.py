"""The protocol every accelerator backend implements, and the ops a model takes from its backend.

A backend owns everything that depends on the device: the model's weights in its format, the KV
pool (layout, dtype, sizing from a memory budget), turning a batch into inputs and attention
metadata, the forward, warm-up or graph capture, and sampling. `ModelRunner` keeps the rest
(the sequence table, deltas, which rows sample, the multi-step loop), the same for every backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from services.worker.backends.kv_pool import KVSpec
from services.worker.logits_processors import SampleRow
from services.worker.model_config import ModelConfig
from services.worker.sequence import SeqState
from shared.wire.messages import BackendName, Logprobs, WorkerKind

if TYPE_CHECKING:  # images.py reads BatchRow from here
    from services.worker.images import ImageCache

# one scheduled row: the sequence and how many of its tokens this iteration computes
BatchRow = tuple[SeqState, int]


class LayerOps(Protocol):
    """What a transformer layer calls; each backend hands the model its own (torch, Triton, ...)."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  kv_cache: tuple[torch.Tensor, torch.Tensor], meta: Any, scale: float,
                  window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """Write this step's K/V through the slot mapping, then attend over each row's context (a
        sliding-window layer's query at position p: over positions p - window + 1 .. p; a soft cap:
        each score s -> softcap * tanh(s / softcap) before the softmax).
        q: [T, heads, d], k/v: [T, kv_heads, d] -> [T, heads, d]."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual) * weight, x + residual)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-split rotary embedding; cos/sin: [T, d]."""

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 * n] (gate, up side by side) -> silu(gate) * up, [T, n]."""

    def routed_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                       experts: torch.Tensor) -> torch.Tensor:
        """x [T, H] through each token's top-k SwiGLU experts (w13 [E, 2I, H]: gate rows then up;
        w2 [E, H, I]; experts and their routing weights [T, k]), weighted and summed -> [T, H]."""

    def lora_add(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: Any,
                 out_sizes: list[int]) -> torch.Tensor:
        """y [T, out] += b[s] @ a[s] @ x[t] for each token t whose row runs on the adapter in slot s
        (rows: lora/layers.py's LoraRows; a [S, R', in], b [S, out, R']) -> y (added in place or not).
        b is block-diagonal: output slice i (out_sizes) is zero outside columns i*R'/n..; an op may
        skip the zeros."""


class ForwardInputs(Protocol):
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: Any  # the backend's own attention metadata


class Encoder(Protocol):
    """A bidirectional model that pools a prompt into one vector (models/bert.py)."""

    def embed(self, prompts: list[list[int]]) -> torch.Tensor:
        """Each prompt's pooled vector -> [n, dim]."""


@dataclass(frozen=True)
class BackendInfo:
    """What the worker announces about its backend (the backend's fields of WorkerHello)."""

    backend: BackendName
    kind: WorkerKind
    num_blocks: int
    block_size: int
    dtype: str  # the weights' compute dtype
    device: str  # what computes, for /v1/models, e.g. "cpu (bfloat16, ...)", "qaic, emulated on cpu"
    prefill_seq_len: int = 0  # a slots backend's most prefill tokens per step
    kv_cache_dtype: str | None = None  # the pool's own, where the backend picks it (None: as configured)


class Backend(Protocol):
    name: BackendName
    kind: WorkerKind
    device: torch.device
    model: torch.nn.Module
    config: ModelConfig  # the model's architecture
    encoder: Encoder | None  # an encoder model pools instead of sampling (only the torch CPU backend runs one)
    images: ImageCache | None  # an image-text model's images (only the torch CPU backend runs them)
    draft: Backend | None  # speculative decoding's draft model over the same KV blocks (the torch CPU backend's)
    kv: KVSpec  # the pool's geometry and dtype (a slots backend's: qaic/kv_slots.py's SlotKVSpec)
    block_size: int
    num_blocks: int  # usable KV blocks (announced; a slots backend's: its slots); a paged pool holds one more, the null block

    def prepare(self, batch: list[BatchRow]) -> ForwardInputs:
        """The iteration's ragged batch as device tensors and attention metadata."""

    def forward(self, inputs: ForwardInputs) -> torch.Tensor:
        """-> hidden states [num_tokens, hidden] after the final norm."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> float32 logits [n, vocab]."""

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[Logprobs | None]]:
        """One token per row (and its logprobs when asked); the sampled ids are the only host sync."""

    def warm_up(self) -> float:
        """Compile or capture what serving needs before the worker says hello (the CPU backend
        compiles in the background instead); returns seconds."""

    def kv_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by KV block (dim 0), the draft's too: what the host KV tier copies
        (a paged backend's; a slots backend has none)."""

    def describe(self) -> BackendInfo:
        """What the worker announces about its backend; its device line may change while it serves
        (the CPU backend's background compile ending)."""
