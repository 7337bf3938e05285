"""vLLM's async engine API, the subset a custom runtime's script uses, served by Switchyard's own
scheduler and workers: `vllm` in a custom model's requirements is this (docs/deploy.md says which
calls and fields)."""

from vllm.engine.async_llm_engine import AsyncLLMEngine
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams

__version__ = "0.6.6+switchyard"
__all__ = ["AsyncLLMEngine", "CompletionOutput", "RequestOutput", "SamplingParams"]
