"""The scheduler's loop and the worker's runner in one process, without the bus.

Used to test batching invariants exactly (no timing): the services run this same loop over NATS.
"""

from __future__ import annotations

import torch

from services.scheduler.host_tier import TierIndex
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.worker.backends.eagle3 import Eagle3Drafter
from services.worker.backends.kv_pool import KVSpec
from services.worker.backends.torch_cpu.backend import TorchCpuBackend
from services.worker.draft_proposer import DraftModelProposer
from services.worker.eagle_proposer import Eagle3Proposer
from services.worker.models.eagle3 import load_eagle3
from services.worker.ngram import NgramProposer
from services.worker.suffix import SuffixProposer
from shared.speculative import parse_speculative_config
from shared.wire.hashing import root_hash
from shared.wire.messages import SamplingParams, StepResult
from shared.wire.spec_decode import Drafts
from tests.model_helpers import make_runner

BLOCK_SIZE = 16


class InProcessEngine:
    def __init__(self, loaded, num_blocks: int, max_num_seqs: int = 64, max_num_batched_tokens: int = 256,
                 num_scheduler_steps: int = 1, runner=None, scheduler: Scheduler | None = None,
                 speculative: dict | None = None, draft=None, tier=None):
        """runner: the worker side (default: the torch backend's over `loaded`, num_blocks blocks);
        scheduler: the scheduler side (default: paged, over num_blocks blocks); speculative: a
        --speculative-config, as the worker announces it to the scheduler; draft: the draft_model
        method's model (a LoadedModel), its KV in the runner's blocks as its backend holds it (None:
        the runner's backend was created with one); the eagle3 method's head (its folder), the runner's
        model then keeping the streams it reads. tier: a
        worker's HostTier (services/worker/kv_tier.py), indexed by the scheduler as one pool's."""
        if runner is None:
            head = getattr(loaded.model.output, "weight", None)  # a quantized head (QuantLinear) has none
            runner = make_runner(loaded, num_blocks, kv_dtype=torch.float32 if head is None else head.dtype,
                                 max_model_len=8192, block_size=BLOCK_SIZE)
        self.runner = runner
        spec = parse_speculative_config(speculative)
        if spec is not None and spec.method == "draft_model":
            backend = self.runner.backend
            if draft is not None:  # else the runner's backend was created with its draft
                kv = KVSpec.of(draft.config, BLOCK_SIZE, backend.kv.dtype)  # the target backend's kind, its device
                backend.draft = TorchCpuBackend(draft, kv, backend.num_blocks) \
                    if isinstance(backend, TorchCpuBackend) else type(backend)(draft, kv, backend.num_blocks, backend.device)
            self.runner.proposer = DraftModelProposer(spec)
        elif spec is not None and spec.method == "eagle3":  # draft: the head's folder
            backend = self.runner.backend
            head, layers = load_eagle3(draft, backend.model, backend.config, backend.model.layers[0].attention.ops,
                                       backend.kv.dtype)
            backend.model.aux_layers = tuple(layers)
            device = getattr(backend, "device", torch.device("cpu"))  # the CUDA backend's, on a GPU
            backend.draft = Eagle3Drafter(head.to(device), KVSpec.of(head.config, BLOCK_SIZE, backend.kv.dtype),
                                          backend.num_blocks, backend.prepare, device)
            self.runner.proposer = Eagle3Proposer(spec)
        elif spec is not None:
            self.runner.proposer = SuffixProposer(spec) if spec.method == "suffix" else NgramProposer(spec)
        self.runner.tier = tier
        kv = KVCacheManager(num_blocks, BLOCK_SIZE, root_hash("test-model", "auto"),
                            tier=TierIndex(tier.info()) if tier is not None else None)
        self.scheduler = scheduler or Scheduler(
            kv, max_num_seqs, max_num_batched_tokens, num_scheduler_steps=num_scheduler_steps,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0, spec_max_batch=spec.max_batch if spec else 0)
        self.drafts: list[Drafts] = []  # every row's speculation, step by step
        self.outputs: dict[str, list[int]] = {}
        self.logprobs: dict[str, list[float]] = {}  # each sampled token's, for requests that ask (logprobs=0)
        self.num_cached_tokens: dict[str, int] = {}
        self.errors: dict[str, str] = {}  # requests whose row failed on the worker
        self.embeddings: dict[str, bytes] = {}  # pooling requests' outputs
        self.steps_run = 0

    def add(self, request_id: str, prompt_ids: list[int], max_tokens: int, **sampling) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=sampling.pop("temperature", 0.0), **sampling)
        self.scheduler.add_request(Request(request_id, list(prompt_ids), params, reply_to=""))

    def step(self) -> None:
        plan = self.scheduler.schedule()
        result = StepResult(step_id=plan.step.step_id)
        for iteration in self.runner.iterations(plan.step):  # as the worker service runs a (multi-step) Step
            out = self.runner.execute(iteration)
            result.sampled += out.sampled
            result.drafts += out.drafts
            result.iteration_sizes.append(len(out.sampled))
            for request_id, logprobs in out.logprobs.items():
                self.logprobs.setdefault(request_id, []).extend(lp.logprob for lp in logprobs)
            self.embeddings.update(out.embeddings)
        self.scheduler.kv.end_transfers(ok=True)  # as the pool's loop does once the Step is back
        self.drafts += result.drafts
        finished = self.scheduler.update(plan, result)
        for f in finished:
            self.outputs[f.request.request_id] = f.request.output_token_ids
            self.num_cached_tokens[f.request.request_id] = f.request.num_cached_tokens
            if f.error is not None:
                self.errors[f.request.request_id] = f.error
        self.steps_run += 1

    def run(self, max_steps: int = 10_000) -> dict[str, list[int]]:
        while self.scheduler.has_work and self.steps_run < max_steps:
            self.step()
        return self.outputs
