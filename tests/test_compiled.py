"""`--compile`: the compiled decode layers compute what the eager layers compute (the same C kernels:
the same bits on the GGUF's blocks), the start-up warm-up leaves no graph to compile under load,
a compile that cannot work is known in seconds, and an open compile changes no eager step."""

from __future__ import annotations

import threading

import msgspec
import pytest
import torch

from services.worker.backends.torch_cpu.compiled import MAX_BATCH, BackgroundCompile, CompiledLayers
from services.worker.backends.torch_cpu.ops import NATIVE_OPS
from services.worker.backends.torch_cpu.quantization import QuantLinear, native_blocks, quantize
from services.worker.loader import load_model
from services.worker.model_runner import ModelRunner
from services.worker.models.llama import run_layers
from shared.wire.messages import NewSeq, SamplingParams, ScheduledSeq, Step
from tests.model_helpers import BLOCK_SIZE, make_runner
from tests.test_llama_vs_hf import PROMPTS

DECODE_STEPS = 3
FIRST_LAYERS = 9


@pytest.fixture(scope="module")
def probe_cache(tmp_path_factory):
    """One probe for the module's compiles, as a worker's later starts on the host read its first's answer."""
    return tmp_path_factory.mktemp("compile-probe")


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
    step = Step(step_id=1, scheduled=[ScheduledSeq(f"s{i}", 1, runner.seqs[f"s{i}"].num_computed_tokens)
                                      for i in range(num_seqs)])
    batch = runner.apply_deltas(step)
    logits = runner.backend.compute_logits(runner.backend.forward(runner.backend.prepare(batch)))
    for i, (seq, _) in enumerate(batch):
        seq.num_computed_tokens += 1
        seq.token_ids.append(int(logits[i].argmax()))
    return logits


# gguf: every op of a decode step is a C kernel's, compiled or not: the same bits. w8a8: the same GEMM, but the rows it quantizes differ from eager's in the last bits (Inductor fuses
# the division by the row's max), and at a rounding edge of the uint8 grid that is a whole level;
# through the whole model's 30 layers logits moved by up to ~2 at 0.2% of the entries (the bound kept for its first 9)
@pytest.mark.slow
@pytest.mark.parametrize("quantization,atol,min_agreement", [("gguf", 0.0, 1.0), ("w8a8", 3.0, 0.9)])
def test_compiled_decode_matches_eager_with_no_compile_after_warm_up(default_model_path, hf_tokenizer, probe_cache,
                                                                      cpu_kernels, quantization, atol, min_agreement):
    loaded = load_model(default_model_path, ops=NATIVE_OPS)
    quantize(loaded.model, quantization, native_blocks(loaded, quantization))
    model = loaded.model
    # the first FIRST_LAYERS layers, compiled and eager alike: three runs of 3 (the whole model's are
    # five of 6, compiled by the cold-start stack test), so half the graph to compile and a third of the steps
    model.layers = model.layers[:FIRST_LAYERS]
    loaded.config = msgspec.structs.replace(loaded.config, num_layers=FIRST_LAYERS)  # the KV pool's layers
    if quantization == "gguf":  # the last layer in another form (its rows int8), as a Q4_K_M file's Q6_K layers are
        takers = [m for m in model.layers[-1].modules() if isinstance(m, QuantLinear) and m.takes_int8_rows]
        assert takers
        for layer in takers:
            layer.use_int8_rows()
    compiled_runner, eager_runner = (make_runner(loaded, 256, max_model_len=4096) for _ in range(2))
    # as a worker does it: the compile runs on a thread of its own while the model serves eagerly; at the
    # test's own priority (a worker's nice 19 left it the other xdist worker's idle time: 258 s on 2 cores)
    compiling = BackgroundCompile(model, compiled_runner.backend.kv_caches, BLOCK_SIZE, 16, probe_cache, nice=0)
    assert model.layer_runner is run_layers and compiling.state == "compiling decode steps"
    _start(eager_runner, [hf_tokenizer.encode(PROMPTS[0])])
    _decode_logits(eager_runner, 1, None)
    compiling.thread.join()
    assert compiling.state == "compiled decode steps"
    compiled_layers = model.layer_runner  # installed once every graph is compiled
    assert isinstance(compiled_layers, CompiledLayers)
    compiled_max_batch = compiled_layers.max_batch  # MAX_BATCH; every batch up to 16 for w8a8
    assert compiled_max_batch == (16 if quantization == "w8a8" else MAX_BATCH)
    # a graph for each structure of a run of layers: the last run's own (gguf), not the others' reused
    assert len({id(run) for run in compiled_layers.runs}) == (2 if quantization == "gguf" else 1)
    compiled_calls = []

    def counted(compiled_fn):  # proves the compiled layers ran, so the comparison below is not eager vs eager
        def call(*args):
            compiled_calls.append(args[1].shape[0])
            return compiled_fn(*args)
        return call

    compiled_layers.runs = [counted(run) for run in compiled_layers.runs]

    def decode(runner: ModelRunner, num_seqs: int, tokens) -> torch.Tensor:
        model.layer_runner = compiled_layers if runner is compiled_runner else run_layers
        return _decode_logits(runner, num_seqs, tokens)

    # every graph's batch sizes, a batch above MAX_BATCH (eager, but compiled for w8a8), contexts shorter than one block:
    # no graph is compiled after the warm-up
    agree = total = 0
    with torch.compiler.set_stance("fail_on_recompile"):
        for num_seqs in (1, 2, 5, MAX_BATCH, MAX_BATCH + 3):
            prompts = [hf_tokenizer.encode(PROMPTS[i % len(PROMPTS)])[: 3 + 5 * i] for i in range(num_seqs)]
            for runner in (eager_runner, compiled_runner):
                runner.seqs.clear()
                _start(runner, prompts)
            tokens = None
            for _ in range(DECODE_STEPS):
                expected = decode(eager_runner, num_seqs, tokens).float()
                got = decode(compiled_runner, num_seqs, tokens).float()
                if atol == 0:
                    assert torch.equal(got, expected)
                else:
                    torch.testing.assert_close(got, expected, atol=atol, rtol=0.05)
                agree += int((got.argmax(-1) == expected.argmax(-1)).sum())
                total += num_seqs
                tokens = expected.argmax(-1).tolist()
    assert agree >= min_agreement * total, f"{agree}/{total}"
    calls_per_step = len(model.layers) // compiled_layers.layers_per_call
    expected = [b for b in (1, 2, 5, MAX_BATCH, MAX_BATCH + 3) if b <= compiled_max_batch]
    assert sorted(set(compiled_calls)) == expected  # every batch up to the compiled max, none above
    assert len(compiled_calls) == len(expected) * DECODE_STEPS * calls_per_step


class _OpenCompile:
    """A real torch.compile on a thread of its own, held open inside its backend until `close()`:
    while it is open, torch.compiler.is_compiling() reads True in every thread of the process."""

    def __init__(self):
        self.opened, self.release = threading.Event(), threading.Event()

        def backend(graph_module, example_inputs):
            self.opened.set()
            self.release.wait(timeout=120)
            return graph_module.forward

        self.thread = threading.Thread(
            target=lambda: torch.compile(lambda t: t * 2 + 1, backend=backend)(torch.ones(3)), daemon=True)

    def __enter__(self):
        self.thread.start()
        assert self.opened.wait(timeout=60), "the compile never reached its backend"
        assert torch.compiler.is_compiling()  # the process-wide flag the eager steps must not read
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.thread.join(timeout=60)


def test_a_compile_open_on_another_thread_leaves_eager_steps_as_they_are(default_model_path, hf_tokenizer):
    """The fast path's eager prefill (more than 8 rows) computes the same logits while a compile is
    open on another thread (the background compile of a worker's first start) as with none open."""
    from services.worker.backends.spec import WorkerSpec
    from services.worker.backends.torch_cpu.backend import TorchCpuBackend
    from tests.model_helpers import prefill_logits

    spec = WorkerSpec(model_path=default_model_path, kv_cache_bytes=lambda _: 0, num_kv_blocks=64,
                      dtype="float32", quantization="gguf")
    runner = ModelRunner(TorchCpuBackend.create(spec), max_model_len=1024, eos_token_ids=[])
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = hf_tokenizer.encode(hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                                 add_special_tokens=False)
    assert len(prompt) == 37  # the request: a near tie in float32 that bfloat16 rows flip
    expected = prefill_logits(runner, prompt)
    with _OpenCompile():
        during = prefill_logits(runner, prompt)
    torch.testing.assert_close(during, expected, atol=1e-4, rtol=0)


def test_a_compile_that_cannot_work_is_known_from_its_probe_and_kept(default_model_path, tmp_path, monkeypatch,
                                                                     cpu_kernels):
    """With a C++ compiler that fails (as Inductor's build failed on one AVX-512 CPU), the probe's
    tiny compile fails in its own process in seconds: the worker says so in its device line, serves
    eagerly, and the failure is kept for the next start on this CPU, torch and compiler."""
    from services.worker.backends.torch_cpu.compile_probe import probe

    broken = tmp_path / "g++"
    broken.write_text("#!/bin/sh\necho 'g++ (broken) 12.2.0'\necho 'internal compiler error' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    loaded = load_model(default_model_path, ops=NATIVE_OPS)
    quantize(loaded.model, "gguf", native_blocks(loaded, "gguf"))
    runner = make_runner(loaded, 64)
    compiling = BackgroundCompile(loaded.model, runner.backend.kv_caches, BLOCK_SIZE, 8, tmp_path / "probe",
                                  nice=0)  # at a worker's 19 its probe waited on the other xdist worker: 20-71 s
    compiling.thread.join()
    assert compiling.state.startswith("not compiled: the probe compile failed"), compiling.state
    assert loaded.model.layer_runner is run_layers  # eager, as from the start
    [kept] = (tmp_path / "probe").glob("*.json")
    assert "the probe compile failed" in kept.read_text()
    assert probe(tmp_path / "probe") == compiling.state.removeprefix("not compiled: ")
