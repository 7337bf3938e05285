"""Drive the worker's ModelRunner directly (no bus): the oracle tests' view of our model."""

from __future__ import annotations

import torch

from services.worker.backends.kv_pool import KVSpec
from services.worker.backends.torch_cpu.backend import TorchCpuBackend
from services.worker.model_runner import ModelRunner
from shared.wire.messages import NewSeq, SamplingParams, ScheduledSeq, Step

BLOCK_SIZE = 16


def make_runner(loaded, num_blocks: int = 256, kv_dtype: torch.dtype = torch.float32,
                max_model_len: int | None = None, block_size: int = BLOCK_SIZE) -> ModelRunner:
    """A ModelRunner on the torch backend over `loaded` (whose model is used as it is)."""
    backend = TorchCpuBackend(loaded, KVSpec.of(loaded.config, block_size, kv_dtype), num_blocks)
    return ModelRunner(backend, max_model_len=max_model_len or num_blocks * block_size,
                       eos_token_ids=loaded.config.eos_token_ids)


def prefill_logits(runner: ModelRunner, prompt_ids: list[int]) -> torch.Tensor:
    """Logits for every prompt position, through the paged cache path."""
    num_blocks = (len(prompt_ids) + BLOCK_SIZE - 1) // BLOCK_SIZE
    new = NewSeq(request_id="logits", token_ids=prompt_ids, num_prompt_tokens=len(prompt_ids),
                 num_computed_tokens=0, num_new_tokens=len(prompt_ids), block_ids=list(range(num_blocks)),
                 sampling=SamplingParams(max_tokens=1, temperature=0.0), reply_to="")
    batch = runner.apply_deltas(Step(step_id=0, new_seqs=[new]))
    with torch.inference_mode():
        logits = runner.backend.compute_logits(runner.backend.forward(runner.backend.prepare(batch)))
    runner.seqs.clear()
    return logits


def greedy_generate(runner: ModelRunner, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """One sequence, prefill then decode steps, exactly as the scheduler would send them."""
    total = len(prompt_ids) + max_tokens
    blocks = list(range((total + BLOCK_SIZE - 1) // BLOCK_SIZE))
    # min_tokens bans EOS as transformers' min_new_tokens does, so both run the full length
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, min_tokens=max_tokens)
    new = NewSeq(request_id="gen", token_ids=prompt_ids, num_prompt_tokens=len(prompt_ids),
                 num_computed_tokens=0, num_new_tokens=len(prompt_ids), block_ids=blocks,
                 sampling=sampling, reply_to="")
    out = runner.execute(Step(step_id=0, new_seqs=[new]))
    tokens = [out.sampled[0].token_id]
    while out.sampled[0].finish_reason is None:
        step = Step(step_id=len(tokens), scheduled=[
            ScheduledSeq(request_id="gen", num_new_tokens=1, num_computed_tokens=len(prompt_ids) + len(tokens) - 1)])
        out = runner.execute(step)
        tokens.append(out.sampled[0].token_id)
    return tokens


def serve_checkpoint(tmp_path_factory, name: str, model, tokenizer, *flags: str, processor=None):
    """A transformers model and its tokenizer (and image processor) saved as a Hugging Face
    directory and served under `name` by a stack of `make run`'s services (tests/conftest.py's),
    with `flags` added."""
    from tests.conftest import _start_stack

    folder = tmp_path_factory.mktemp(f"{name}-model")
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    if processor is not None:
        processor.save_pretrained(folder)
    return _start_stack(tmp_path_factory, name, 1, ["--model-path", str(folder), "--model", name, *flags])


def transformers_greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation of `ids`, exactly `num_tokens` long (EOS or not)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                             do_sample=False)
    return out[0, len(ids):].tolist()


def check_batched_as_alone(loaded, vocab: int) -> None:
    """Four prompts sharing two full blocks, greedy for 24 tokens each: batched with 64-token chunks
    in a pool too small for all of them (preempted, prefix-cached), each gives its lone run's tokens."""
    from tests.inproc_engine import InProcessEngine

    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, vocab, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, vocab, (30 + 7 * i,), generator=gen).tolist() for i in range(4)]
    alone = {f"r{i}": greedy_generate(make_runner(loaded, num_blocks=8), p, 24) for i, p in enumerate(prompts)}
    engine = InProcessEngine(loaded, num_blocks=14, max_num_batched_tokens=64)  # 14 blocks of 16: not all four
    for i, p in enumerate(prompts):
        engine.add(f"r{i}", p, 24, min_tokens=24)  # as greedy_generate: the full length, EOS or not
    assert engine.run() == alone
    assert engine.scheduler.num_preemptions > 0
    assert max(engine.num_cached_tokens.values()) >= 32  # a later prompt found the shared blocks


def step_logits(runner: ModelRunner, step) -> torch.Tensor:
    """One step's logits through the runner's backend (its ImageCache sets an image-text model's rows)."""
    backend = runner.backend
    with torch.inference_mode():
        return backend.compute_logits(backend.forward(backend.prepare(runner.apply_deltas(step))))


def greedy_with_images(runner: ModelRunner, ids: list[int], images: list, pixels: list[bytes] | None,
                       block_ids: list[int], decode_steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """A prompt with its images (ImageRefs, their pixels as the media store holds them; None: added
    already) in one prefill, then `decode_steps` greedy decode steps: (the tokens, each step's logits)."""
    for ref, data in zip(images, pixels or [], strict=pixels is not None):
        runner.add_image(ref, data)
    logits = [step_logits(runner, Step(step_id=0, new_seqs=[NewSeq(
        request_id="r", token_ids=ids, num_prompt_tokens=len(ids), num_computed_tokens=0, num_new_tokens=len(ids),
        block_ids=block_ids, sampling=SamplingParams(max_tokens=decode_steps + 1, temperature=0.0), reply_to="",
        images=images)]))]
    tokens = list(ids)
    for _ in range(decode_steps):
        tokens.append(int(logits[-1][-1].argmax()))
        seq = runner.seqs["r"]
        seq.num_computed_tokens = len(tokens) - 1
        seq.token_ids.append(tokens[-1])
        logits.append(step_logits(runner, Step(step_id=len(tokens), scheduled=[
            ScheduledSeq(request_id="r", num_new_tokens=1, num_computed_tokens=len(tokens) - 1)])))
    return tokens, logits


def cuda_image_runner(folder: str, num_blocks: int = 16, device: str = "cpu", dtype: torch.dtype = torch.float32,
                      graphs: bool = False) -> ModelRunner:
    """An image-text checkpoint on the CUDA backend: on the CPU its Triton kernels interpreted
    (float32); on a GPU in `dtype`, decode steps through CUDA graphs if asked."""
    from services.worker.backends.cuda.backend import CudaBackend
    from services.worker.backends.cuda.ops import TritonOps
    from services.worker.loader import load_model

    loaded = load_model(folder, dtype=dtype, ops=TritonOps(), device=device)
    backend = CudaBackend(loaded, KVSpec.of(loaded.config, BLOCK_SIZE, dtype), num_blocks, torch.device(device),
                          capture=(4, 512) if graphs else None)
    backend.warm_up()
    return ModelRunner(backend, max_model_len=512, eos_token_ids=[])


def chunked_logits(runner: ModelRunner, ids: list[int], images: list, chunks: list[int | None],
                   block_ids: list[int]) -> torch.Tensor:
    """A prompt with its images (already added to the runner) prefilled in `chunks` (None: the rest),
    none ending inside an image (the scheduler's rule): every position's logits."""
    got, start = [], 0
    for i, size in enumerate(chunks):
        num = size or len(ids) - start
        if i == 0:
            step = Step(step_id=0, new_seqs=[NewSeq(
                request_id="r", token_ids=ids, num_prompt_tokens=len(ids), num_computed_tokens=0, num_new_tokens=num,
                block_ids=block_ids, sampling=SamplingParams(max_tokens=8, temperature=0.0), reply_to="",
                images=images)])
        else:
            step = Step(step_id=i, scheduled=[ScheduledSeq(request_id="r", num_new_tokens=num, num_computed_tokens=start)])
        assert not any(image.offset < start + num < image.end for image in images)
        got.append(step_logits(runner, step))
        runner.seqs["r"].num_computed_tokens = start + num
        start += num
    return torch.cat(got)


def generate_with_logprobs(model, ids: list[int], num_tokens: int, **inputs) -> tuple[list[int], list[float]]:
    """transformers' greedy generate of exactly `num_tokens` (an image-text model's `inputs` beside
    the ids): the tokens, and each one's logprob."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, **inputs)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, tokens, strict=True)]


def answer_logprobs(answer) -> list[float]:
    """An openai client's chat completion's logprobs, token by token."""
    return [entry.logprob for entry in answer.choices[0].logprobs.content]
