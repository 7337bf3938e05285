"""The transformers peer: Hugging Face `generate` over static, left-padded batches of the same prompts.

Requests "arrive" together; batches of `concurrency` run one after another, each until its
longest request is done (static batching). A request's TTFT is when its batch produced its first
token; its E2E when the batch produced its own last token. Reported like `bench.serve`.
"""

from __future__ import annotations

import os
import time

import torch
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

from bench import dataset, report
from bench.client import RequestResult
from bench.stats import summarize
from shared.models.model_files import default_model_path


class StepClock(StoppingCriteria):
    """Called once per generated token: records when each step finished."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def run_batch(model, prompts: list[dataset.Prompt], t0: float) -> list[RequestResult]:
    ids = [p.prompt if isinstance(p.prompt, list) else None for p in prompts]
    assert all(i is not None for i in ids), "the transformers peer takes token-id prompts"
    width = max(len(i) for i in ids)
    input_ids = torch.tensor([[0] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    steps = max(p.max_tokens for p in prompts)
    clock = StepClock()
    with torch.inference_mode():
        model.generate(input_ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                       pad_token_id=0, stopping_criteria=StoppingCriteriaList([clock]))
    results = []
    for p in prompts:
        times = clock.times[: p.max_tokens]
        results.append(RequestResult(ok=True, ttft=times[0] - t0, e2e=times[-1] - t0,
                                     itl=[b - a for a, b in zip(times, times[1:], strict=False)],
                                     num_output_tokens=p.max_tokens, num_prompt_tokens=p.num_tokens))
    return results


def sweep(concurrencies: list[int], num_prompts: int, input_len: int, output_len: str, seed: int = 0,
          threads: int | None = None) -> dict:
    torch.set_num_threads(threads or os.cpu_count() or 2)
    folder, name = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = dataset.load()
    points = []
    for concurrency in concurrencies:
        num = num_prompts or max(8, 4 * concurrency)
        lens = dataset.output_lengths(output_len, num, seed)
        texts = dataset.english_prompts(tokenizer, num, input_len, lens, seed=seed + concurrency)
        prompts = [dataset.Prompt(tokenizer.encode(p.prompt), p.num_tokens, p.max_tokens) for p in texts]
        t0 = time.perf_counter()
        results = []
        for start in range(0, num, concurrency):
            results += run_batch(model, prompts[start : start + concurrency], t0)
        wall = time.perf_counter() - t0
        points.append(summarize(results, wall, concurrency, float("inf")))
        print(f"transformers c={concurrency}: {points[-1]['output_tok_s']:.1f} out tok/s", flush=True)
    return {"label": "transformers", "base_url": "in-process", "model": name, "endpoint": "generate",
            "dataset": "english", "input_len": input_len, "output_len": output_len, "shared_prefix_len": 0,
            "ignore_eos": True, "points": points}


def main(concurrencies: list[int], num_prompts: int, input_len: int, output_len: str, out: str) -> None:
    run = sweep(concurrencies, num_prompts, input_len, output_len)
    print(report.markdown(run))
    report.save(run, out)
