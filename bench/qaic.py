"""`python -m bench.qaic`: the QAIC emulator on the default model (SmolLM2), in process.

    python -m bench.qaic accuracy [--prompts 50 --tokens 32]
    python -m bench.qaic decode [--slots 16 --context 128 --steps 10]

accuracy: greedy token agreement (teacher-forced: each MX variant's argmax at every position of
the float32 torch path's greedy continuation) over English prompts, and perplexity on a fixed
text, for the program without MX formats, with MXFP6 weights, and with MXINT8 KV too.
decode: ms per decode step over all slots against the paged CPU path at the same batch, and the
matmul weights' bytes read per token (MXFP6's image against bfloat16).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile

import torch

from bench import dataset
from bench.profile_step import decode_runner, time_decode
from services.worker.backends.kv_pool import KVSpec
from services.worker.backends.qaic.backend import QaicBackend
from services.worker.backends.qaic.mx_linear import linears
from services.worker.backends.spec import WorkerSpec
from services.worker.backends.torch_cpu.backend import TorchCpuBackend
from services.worker.backends.torch_cpu.ops import TORCH_OPS
from services.worker.loader import load_model
from services.worker.model_runner import ModelRunner
from services.worker.sequence import SeqState
from shared.control.deploy_config import QaicConfig
from shared.models.model_files import default_model_path
from shared.wire.messages import NewSeq, SamplingParams, ScheduledSeq, Step

VARIANTS = {"static shapes, float32": {}, "+ mxfp6 weights": {"mxfp6_matmul": True},
            "+ mxint8 kv": {"mxfp6_matmul": True, "mxint8_kv_cache": True}}


def qaic(slots: int, ctx_len: int, chunk: int, **formats) -> QaicBackend:
    config = QaicConfig(num_cores=torch.get_num_threads(), full_batch_size=slots, ctx_len=ctx_len,
                        prefill_seq_len=chunk, **formats)
    return QaicBackend.create(WorkerSpec(model_path=default_model_path(), kv_cache_bytes=lambda _: 0,
                                         qaic=config).with_dtype_for("qaic"))


def logits_over(backend, ids: list[int], chunk: int) -> torch.Tensor:
    """Every position's logits, the sequence run through the backend chunk by chunk (slot / blocks 0..)."""
    seq = SeqState("x", list(ids), len(ids), 0, list(range(64)), SamplingParams(), "", 0, 0.0)
    out = []
    while seq.num_computed_tokens < len(ids):
        n = min(chunk, len(ids) - seq.num_computed_tokens)
        out.append(backend.compute_logits(backend.forward(backend.prepare([(seq, n)]))))
        seq.num_computed_tokens += n
    return torch.cat(out)


def greedy(backend, ids: list[int], num_tokens: int, chunk: int) -> list[int]:
    out = []
    for _ in range(num_tokens):  # teacher-forced over a growing sequence: plain, and exact
        out.append(int(logits_over(backend, ids + out, chunk)[-1].argmax()))
    return out


@torch.inference_mode()
def accuracy(args) -> None:
    tokenizer = dataset.load()
    loaded = load_model(default_model_path(), ops=TORCH_OPS)
    reference = TorchCpuBackend(loaded, KVSpec.of(loaded.config, 16, torch.float32), 64)
    prompts = [tokenizer.encode(p.prompt) for p in dataset.english_prompts(tokenizer, args.prompts, 48, [1])]
    text = tokenizer.encode(" ".join(dataset.ENGLISH.split()))[: args.ctx_len]
    continuations = [greedy(reference, ids, args.tokens, 1024) for ids in prompts]

    def score(backend, chunk: int) -> tuple[float, float]:
        agree = total = 0
        for ids, cont in zip(prompts, continuations, strict=True):
            argmax = logits_over(backend, ids + cont, chunk)[len(ids) - 1 : -1].argmax(-1).tolist()
            agree += sum(a == b for a, b in zip(argmax, cont, strict=True))
            total += len(cont)
        nll = torch.nn.functional.cross_entropy(logits_over(backend, text, chunk)[:-1], torch.tensor(text[1:]))
        return agree / total, math.exp(nll.item())

    rows = [("torch cpu, float32 (reference)", *score(reference, 1024))]
    for name, formats in VARIANTS.items():
        rows.append((f"qaic emulated, {name}", *score(qaic(1, args.ctx_len, args.chunk, **formats), args.chunk)))
    print(f"{args.prompts} prompts of 48 tokens, {args.tokens} greedy tokens each; perplexity over {len(text)} tokens")
    for name, agree, ppl in rows:
        print(f"{name:42s} agreement {agree * 100:6.2f}%  perplexity {ppl:8.3f}")


@torch.inference_mode()
def decode(args) -> None:
    loaded = load_model(default_model_path(), ops=TORCH_OPS)
    paged = time_decode(decode_runner(loaded, args.slots, args.context, args.steps + 1), args.slots, args.steps)
    print(f"torch cpu, paged, float32          batch {args.slots}: {paged * 1e3:7.1f} ms/step")
    weights = sum(m.weight.numel() for _, _, _, m in linears(loaded.model))
    for name, formats in VARIANTS.items():
        backend = qaic(args.slots, args.ctx_len, args.chunk, **formats)
        runner = ModelRunner(backend, max_model_len=args.ctx_len, eos_token_ids=[])
        sampling = SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True)
        for i in range(args.slots):
            ids = [(7 * i + j) % 1000 + 100 for j in range(args.context)]
            new = NewSeq(f"s{i}", ids, args.context, 0, min(args.chunk, args.context), [i], sampling, "")
            runner.execute(Step(step_id=0, new_seqs=[new]))
            while (done := runner.seqs[f"s{i}"].num_computed_tokens) < args.context:
                runner.execute(Step(step_id=0, scheduled=[ScheduledSeq(f"s{i}", min(args.chunk, args.context - done), done)]))
        seconds = time_decode(runner, args.slots, args.steps)
        print(f"qaic emulated, {name:20s} batch {args.slots}: {seconds * 1e3:7.1f} ms/step ({seconds / paged:.2f}x paged)")
        if backend.program.weight_image:
            print(f"  matmul weights read per decode step: {backend.program.image_bytes / 2**20:.1f} MiB MXFP6 "
                  f"against {weights * 2 / 2**20:.1f} MiB bfloat16 ({backend.program.image_bytes / (weights * 2):.3f}x)")


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=("accuracy", "decode"))
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--ctx-len", type=int, default=256)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads or torch.get_num_threads())
    os.environ.setdefault("SWITCHYARD_CACHE", tempfile.mkdtemp(prefix="bench-qaic-"))  # a fresh compile
    accuracy(args) if args.what == "accuracy" else decode(args)


if __name__ == "__main__":
    main()
