"""Speculative decoding's eagle3 method: heads written by vLLM's `speculators`, the head's step
against speculators' own forward, and served tokens against the engine without speculation.

The target is a 4-layer Llama with random weights saved by transformers, the heads are random (or
built to repeat the target's last token) and saved by speculators: they test the arithmetic and the
bookkeeping, not a trained head's acceptance."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
eagle3 = pytest.importorskip("speculators.models.eagle3")

from services.worker.backends.spec import WorkerSpec  # noqa: E402
from services.worker.backends.torch_cpu.backend import TorchCpuBackend  # noqa: E402
from services.worker.eagle_proposer import _HeadRow  # noqa: E402
from services.worker.sequence import SeqState  # noqa: E402
from shared.checks import ConfigError  # noqa: E402
from shared.wire.messages import SamplingParams  # noqa: E402

VOCAB, LAYERS, AUX = 512, 4, [1, 2, 4]  # 4 = the stream after the last layer


@pytest.fixture(scope="module")
def target_path(tmp_path_factory) -> str:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
                                      eos_token_id=2, rms_norm_eps=1e-6)
    folder = tmp_path_factory.mktemp("target")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def _head_model(target_path: str, draft_vocab: int, **flags):
    """speculators' Eagle3DraftModel for the target, as its training sets it up (the target's
    embeddings, and its lm_head's rows of the draft vocabulary)."""
    torch.manual_seed(1)
    config = transformers.AutoConfig.from_pretrained(target_path)
    config.num_hidden_layers = 1
    t2d = d2t = None
    if draft_vocab != VOCAB:
        kept = torch.randperm(VOCAB)[:draft_vocab].sort().values
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[kept] = True
        d2t = kept - torch.arange(draft_vocab)
    return eagle3.Eagle3DraftModel.from_training_args(
        config, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab, norm_before_residual=flags.pop("norm_before_residual", False),
        ttt_steps=3, verifier_name_or_path=target_path, target_layer_ids=AUX, draft_attn_impl="sdpa", **flags)


def _random_head(target_path: str, folder, draft_vocab: int = 128, **flags):
    model = _head_model(target_path, draft_vocab, **flags)
    with torch.no_grad():  # norms of their own, so one mixed up with another shows
        for name, p in model.named_parameters():
            if "norm" in name and "verifier" not in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return model, str(folder)


def _repeating_head(target_path: str, folder) -> str:
    """A head whose layer adds nothing and whose fc passes the target's last stream: it drafts the
    target's own prediction at the position before, i.e. the token just sampled, again (kept
    wherever the target repeats itself, as a random model's greedy text soon does)."""
    model = _head_model(target_path, VOCAB)
    target = transformers.LlamaForCausalLM.from_pretrained(target_path)
    hidden = target.config.hidden_size
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, 2 * hidden:] = torch.eye(hidden)
        model.layers[0].self_attn.o_proj.weight.zero_()
        model.layers[0].mlp.down_proj.weight.zero_()
        model.norm.weight.copy_(target.model.norm.weight)
        model.lm_head.weight.copy_(target.lm_head.weight)
    model.save_pretrained(folder)
    return str(folder)


def _backend(target_path: str, head_path: str, num_blocks: int = 64, deterministic: bool = True) -> TorchCpuBackend:
    return TorchCpuBackend.create(WorkerSpec(model_path=target_path, kv_cache_bytes=lambda _: 0, num_kv_blocks=num_blocks,
                                             deterministic=deterministic, draft_model_path=head_path,
                                             draft_method="eagle3"))


def _seq(token_ids: list[int], num_blocks: int) -> SeqState:
    return SeqState(request_id="a", token_ids=list(token_ids), num_prompt_tokens=len(token_ids), num_computed_tokens=0,
                    block_table=list(range(num_blocks)), sampling=SamplingParams(max_tokens=1), reply_to="",
                    num_cached_tokens=0, first_scheduled_at=0.0)


@pytest.mark.parametrize("flags", [{}, {"norm_before_residual": True}, {"norm_before_fc": True}, {"fc_norm": True},
                                   {"norm_output": True}])
def test_the_heads_step_is_speculators_own(target_path, tmp_path, flags, cpu_kernels):
    """The target's streams as transformers computes them (its hidden_states), and the head's logits
    at every position of a prompt as speculators' forward computes them, within 1e-4."""
    model, head_path = _random_head(target_path, tmp_path, **flags)
    backend = _backend(target_path, head_path)
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    seq = _seq(ids, 3)
    backend.forward(backend.prepare([(seq, len(ids))]))
    aux = backend.model.aux_hidden
    hf = transformers.LlamaForCausalLM.from_pretrained(target_path).eval()
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    # transformers' last entry is after the final norm; the head reads the stream before it
    expected = torch.cat([states[i][0] for i in AUX[:-1]] + [aux[:, 2 * 64:]], -1)
    torch.testing.assert_close(aux, expected, atol=1e-5, rtol=1e-5)

    drafter, n = backend.draft, len(ids) - 1  # at position p the head reads token p + 1
    _, normed = drafter.forward([(_HeadRow(seq, 0), n)], drafter.head.fuse(aux[:n]))
    ours = drafter.head.lm_head(normed).float()
    logits = []
    handle = model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out))
    with torch.no_grad():
        tokens = model(hidden_states=aux[:n].unsqueeze(0), input_ids=torch.tensor([ids[1:]]),
                       document_ids=torch.zeros(1, n, dtype=torch.long), position_ids=torch.arange(n).unsqueeze(0),
                       ttt_steps=1)
    handle.remove()
    torch.testing.assert_close(ours, logits[0][0].float(), atol=1e-4, rtol=1e-4)
    mapped = drafter.head.draft_tokens(normed)
    assert mapped == (tokens[0][0] + model.d2t[tokens[0][0]]).tolist()  # a draft id + d2t: the target's token
    assert "EAGLE-3 head drafting from 128 tokens" in backend.describe().device

    # the fast path (the C kernels' norms, attention and packed Linears) keeps and reads the same streams
    fast = _backend(target_path, head_path, deterministic=False)
    assert fast.native
    seq = _seq(ids, 3)
    fast.forward(fast.prepare([(seq, len(ids))]))
    torch.testing.assert_close(fast.model.aux_hidden, aux, atol=1e-4, rtol=1e-4)
    _, fast_normed = fast.draft.forward([(_HeadRow(seq, 0), n)], fast.draft.head.fuse(fast.model.aux_hidden[:n]))
    torch.testing.assert_close(fast.draft.head.lm_head(fast_normed).float(), ours, atol=1e-3, rtol=1e-3)


def test_a_head_that_does_not_fit_the_model_is_refused_naming_why(target_path, tmp_path):
    _, head_path = _random_head(target_path, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for change, message in [({"speculators_model_type": "eagle"}, "not an EAGLE-3 head"),
                            ({"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}, "does not have"),
                            ({"target_hidden_size": 128}, "hidden size 128"),
                            ({"norm_everything": True}, r"sets \['norm_everything'\]")]:
        (tmp_path / "config.json").write_text(json.dumps(config | change))
        with pytest.raises(ConfigError, match=message):
            _backend(target_path, head_path)


# ---- served tokens: those of the engine without speculation ---------------------------------------

SPEC = {"method": "eagle3", "model": "the-head", "num_speculative_tokens": 4, "disable_by_batch_size": 8}


@pytest.fixture(scope="module")
def target(target_path):
    from services.worker.backends.torch_cpu.ops import TORCH_OPS
    from services.worker.loader import load_model

    return load_model(target_path, ops=TORCH_OPS)


@pytest.fixture(scope="module")
def heads(target_path, tmp_path_factory) -> dict[str, str]:
    return {"random": _random_head(target_path, tmp_path_factory.mktemp("random"))[1],
            "repeating": _repeating_head(target_path, tmp_path_factory.mktemp("repeating"))}


def _run(target, speculative, head=None, num_blocks=128, budget=256, steps=1, **sampling):
    from tests.inproc_engine import InProcessEngine

    engine = InProcessEngine(target, num_blocks=num_blocks, max_num_batched_tokens=budget, num_scheduler_steps=steps,
                             speculative=speculative, draft=head)
    engine.head_forwards = 0
    if head is not None:  # counted: a row backing off defers its head's work
        drafter, forward = engine.runner.backend.draft, engine.runner.backend.draft.forward

        def counted(*args):
            engine.head_forwards += 1
            return forward(*args)

        drafter.forward = counted
    try:
        prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                   for n in (5, 23, 40, 61, 90)]
        for i, p in enumerate(prompts):
            engine.add(f"r{i}", p, 40, ignore_eos=True, **sampling)
        outputs = engine.run()
    finally:
        target.model.aux_layers = ()  # the module's target serves the runs without a head too
    assert engine.scheduler.kv.pool.num_free == num_blocks  # no block held after, lookahead ones included
    assert not engine.errors
    return outputs, engine


@pytest.mark.parametrize("case", ["repeating-greedy", "repeating-seeded", "repeating-small-pool",
                                  "repeating-chunked", "repeating-multi-step", "random-greedy", "random-seeded"])
def test_an_eagle3_head_gives_the_tokens_of_the_engine_without_it(target, heads, case):
    """repeating: most drafts kept where the text repeats, so the head's KV is caught up on several
    positions at once; random: most rejected. small-pool: rows preempted and recomputed (the head's
    KV with them); chunked: prompts in chunks of 16 beside decoding rows; multi-step: 4 iterations a Step."""
    head, _, variant = case.partition("-")
    sampling = {"seeded": {"temperature": 0.8, "seed": 7}}.get(variant, {})
    kwargs = {"small-pool": {"num_blocks": 14}, "chunked": {"budget": 16}, "multi-step": {"steps": 4}}.get(variant, {})
    plain, _ = _run(target, None, **kwargs, **sampling)
    spec, engine = _run(target, SPEC, heads[head], **kwargs, **sampling)
    assert spec == plain
    proposed, accepted = sum(d.num_drafted for d in engine.drafts), sum(d.num_accepted for d in engine.drafts)
    assert proposed > 0
    if head == "repeating" and variant != "seeded":
        assert accepted > proposed / 4  # not vacuous: kept drafts' KV and the head's catch-up both ran
    if head == "random":  # every draft rejected: the rows back off, and their head's work waits with them
        assert accepted == 0 and engine.head_forwards < engine.steps_run / 2
    if variant == "small-pool":
        assert engine.scheduler.num_preemptions > 0


def test_the_worker_serves_the_head_its_flag_names_at_the_cpu_defaults(target_path, heads, tmp_path, monkeypatch):
    """--speculative-config naming a head folder (the method inferred from its name, as vLLM does)
    through the worker's settings, the engine defaults of this CPU (the C kernels), its backend and its
    proposer; the pool counts the head's weights and each block holds its layer's KV."""
    import shutil
    import sys

    from services.worker.__main__ import engine_defaults, parse_args, spec_proposer, worker_spec
    from services.worker.backends import create_backend
    from services.worker.eagle_proposer import Eagle3Proposer
    from services.worker.settings import resolve

    head = shutil.copytree(heads["random"], tmp_path / "llama-speculator.eagle3")
    flag = json.dumps({"model": str(head), "num_speculative_tokens": 3})
    monkeypatch.setattr(sys, "argv", ["worker", "--model-path", target_path, "--speculative-config", flag])
    settings = resolve(parse_args())
    assert settings.config.speculative_config.method == "eagle3"
    spec = worker_spec(settings, engine_defaults(settings))
    assert (spec.draft_model_path, spec.draft_method) == (str(head), "eagle3")
    weights = []
    spec.kv_cache_bytes = lambda w: weights.append(w) or (1 << 20)
    backend = create_backend("cpu", spec)
    assert isinstance(spec_proposer(backend, settings), Eagle3Proposer)
    assert backend.model.aux_layers == tuple(AUX)
    per_block = backend.kv.bytes_per_block + backend.draft.kv.bytes_per_block
    assert backend.num_blocks == (1 << 20) // per_block - 1
    spec.draft_model_path = None
    create_backend("cpu", spec)
    assert weights[0] > weights[1]  # the head's weights count against the budget
    spec.draft_model_path, spec.compile = str(head), True
    with pytest.raises(ConfigError, match="serve it without --compile"):
        create_backend("cpu", spec)


def test_the_heads_state_built_step_by_step_is_the_one_of_a_single_pass(target, target_path, heads):
    """The head's state before each row's first draft, built across prompt chunks, kept drafts,
    rejected ones (their KV written again), positions deferred while a row backs off and a
    preempted row's recompute, equals the head run once over the whole text from the target's states
    of one prefill: its KV held every position it attended to."""
    from services.worker.eagle_proposer import Eagle3Proposer

    seen = []
    observe = Eagle3Proposer.observe

    def recording(self, backend, batch, starts, live):
        observe(self, backend, batch, starts, live)
        seen.extend((list(seq.token_ids), seq.head_state[0].clone()) for seq, _ in batch if seq.head_state)

    Eagle3Proposer.observe = recording
    try:
        _, engine = _run(target, SPEC, heads["random"], num_blocks=14, budget=16)
    finally:
        Eagle3Proposer.observe = observe
    assert engine.scheduler.num_preemptions > 0 and engine.head_forwards < engine.steps_run
    reference = _backend(target_path, heads["random"], num_blocks=16)
    drafter = reference.draft
    for token_ids, state in seen[:: max(1, len(seen) // 12)]:
        seq = _seq(token_ids, 16)
        n = len(token_ids) - 1  # the target computed them; the last is the one just sampled
        reference.forward(reference.prepare([(seq, n)]))
        out, _ = drafter.forward([(_HeadRow(seq, 0), n)], drafter.head.fuse(reference.model.aux_hidden))
        torch.testing.assert_close(out[-1], state, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # Triton interpreted on the CPU
def test_an_eagle3_head_on_the_cuda_path_gives_the_torch_backends_tokens(target_path, heads):
    """The CUDA backend's Triton kernels (on a GPU where there is one, else interpreted) run the
    target, keep its streams and run the head over their own blocks; the tokens are the torch
    backend's without speculation, with drafts kept (the repeating head) and a pool small enough to
    preempt."""
    from services.worker.backends.cuda.backend import CudaBackend
    from services.worker.backends.cuda.ops import TritonOps
    from services.worker.backends.kv_pool import KVSpec
    from services.worker.backends.torch_cpu.ops import TORCH_OPS
    from services.worker.loader import load_model
    from services.worker.model_runner import ModelRunner
    from tests.inproc_engine import BLOCK_SIZE, InProcessEngine
    from tests.kernels.test_cuda_backend import DEVICE

    reference, triton = load_model(target_path, ops=TORCH_OPS), load_model(target_path, ops=TritonOps(), device=DEVICE)
    backend = CudaBackend(triton, KVSpec.of(triton.config, BLOCK_SIZE, torch.float32), 9, DEVICE)
    runner = ModelRunner(backend, max_model_len=4096, eos_token_ids=[])
    prompts = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 30, 45)]
    outputs, engines = [], []
    for loaded, runner_, spec in ((reference, None, None), (triton, runner, SPEC)):
        engine = InProcessEngine(loaded, num_blocks=9, max_num_batched_tokens=32, runner=runner_, speculative=spec,
                                 draft=heads["repeating"])
        for i, ids in enumerate(prompts):
            engine.add(f"r{i}", ids, 24, ignore_eos=True)
        outputs.append(engine.run())
        engines.append(engine)
    assert outputs[1] == outputs[0]
    assert sum(d.num_accepted for d in engines[1].drafts) > 0 and engines[1].scheduler.num_preemptions > 0
    assert "EAGLE-3 head drafting from 512 tokens" in backend.describe().device
