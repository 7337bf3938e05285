"""`--compile`: the compiled decode layers compute what the eager layers compute (the faster path is
checked against the torch path), and the start-up warm-up leaves no graph to compile under load."""

from __future__ import annotations

import torch

from services.worker.compiled import WARM_UP_BATCHES, compile_decode_layers, warm_up
from services.worker.loader import load_model
from services.worker.model_runner import ModelRunner
from shared.messages import NewSeq, SamplingParams, ScheduledSeq, Step
from tests.model_helpers import BLOCK_SIZE, make_runner
from tests.test_llama_vs_hf import PROMPTS

DECODE_STEPS = 3


def _start(runner: ModelRunner, prompts: list[list[int]]) -> None:
    blocks_per_seq = 8
    sampling = SamplingParams(max_tokens=64, temperature=0.0)
    for i, ids in enumerate(prompts):
        runner.execute(Step(step_id=0, new_seqs=[NewSeq(
            request_id=f"s{i}", token_ids=ids, num_prompt_tokens=len(ids), num_computed_tokens=0,
            num_new_tokens=len(ids), block_ids=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
            sampling=sampling, reply_to="")]))


@torch.inference_mode()  # as ModelRunner.execute builds its inputs: dynamo guards on inference tensors
def _decode_logits(runner: ModelRunner, num_seqs: int, next_tokens: list[int] | None) -> torch.Tensor:
    """One decode step for every sequence, fed `next_tokens` (teacher forcing), -> its logits."""
    if next_tokens is not None:
        for i, token in enumerate(next_tokens):
            runner.seqs[f"s{i}"].token_ids[-1] = token
    step = Step(step_id=1, scheduled=[ScheduledSeq(request_id=f"s{i}", num_new_tokens=1) for i in range(num_seqs)])
    batch = runner.apply_deltas(step)
    input_ids, positions, meta = runner.build_inputs(batch)
    logits = runner.model.compute_logits(runner.model(input_ids, positions, runner.kv_caches, meta))
    for i, (seq, _) in enumerate(batch):
        seq.num_computed_tokens += 1
        seq.token_ids.append(int(logits[i].argmax()))
    return logits


def test_compiled_decode_matches_eager_with_no_compile_after_warm_up(loaded_model, default_model_path,
                                                                      hf_tokenizer):
    compiled = load_model(default_model_path)  # float32, like the eager reference
    compiled_runner = make_runner(compiled)
    compile_decode_layers(compiled.model)
    warm_up(compiled.model, compiled_runner.kv_caches, BLOCK_SIZE)
    eager_runner = make_runner(loaded_model)
    assert eager_runner.model.compiled_layer is None
    # every decode batch size and a context shorter than one block: no graph is compiled after warm-up
    with torch.compiler.set_stance("fail_on_recompile"):
        for num_seqs in (1, 3, max(WARM_UP_BATCHES) + 4):
            prompts = [hf_tokenizer.encode(PROMPTS[i % len(PROMPTS)])[: 3 + 5 * i] for i in range(num_seqs)]
            for runner in (eager_runner, compiled_runner):
                runner.seqs.clear()
                _start(runner, prompts)
            tokens = None
            for _ in range(DECODE_STEPS):
                expected = _decode_logits(eager_runner, num_seqs, tokens)
                got = _decode_logits(compiled_runner, num_seqs, tokens)
                torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
                assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()
                tokens = expected.argmax(-1).tolist()
