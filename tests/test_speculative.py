"""Speculative decoding (n-gram prompt lookup): vLLM's config, the proposer, the scheduler's lookahead
slots, and tokens equal to the same engine's without speculation (greedy and seeded), with drafts
actually accepted."""

from __future__ import annotations

import argparse

import pytest

from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.worker.ngram import NgramProposer
from shared.checks import ConfigError
from shared.config import add_engine_args, engine_config_from_args
from shared.speculative import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    DRAFT_MODEL_DISABLE_BY_BATCH_SIZE,
    parse_speculative_config,
)
from shared.wire.hashing import root_hash
from shared.wire.messages import FinishReason, Sampled, SamplingParams, StepResult
from tests.inproc_engine import InProcessEngine

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
TEXTS = [  # text the answer is likely to repeat (code, a list, a sentence asked back), and plain text
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Count: one, two, three, four, five, six, seven, eight, nine, ten. Again: one, two,",
    '{"name": "Ada", "age": 36, "city": "London"}\nThe same JSON with the age 37: {"name": "Ada",',
    "Once upon a time",
]


@pytest.fixture(scope="module")
def prompts(hf_tokenizer):
    return [hf_tokenizer.encode(t) for t in TEXTS]


# ---- the config, as vLLM takes it ----------------------------------------------------------------


def test_the_config_takes_vllms_keys_and_defaults():
    spec = parse_speculative_config('{"model": "/models/draft", "num_speculative_tokens": 5}')  # vLLM infers it
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "/models/draft", 5)
    assert spec.max_batch == DRAFT_MODEL_DISABLE_BY_BATCH_SIZE < DEFAULT_DISABLE_BY_BATCH_SIZE
    spec = parse_speculative_config('{"model": "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3", '
                                    '"num_speculative_tokens": 3}')
    assert (spec.method, spec.max_batch) == ("eagle3", DEFAULT_DISABLE_BY_BATCH_SIZE)  # vLLM infers it by name
    spec = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)  # vLLM's when neither is set
    assert spec.max_batch == DEFAULT_DISABLE_BY_BATCH_SIZE
    spec = parse_speculative_config({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 4,
                                     "disable_by_batch_size": 3})
    assert (spec.method, spec.prompt_lookup_min, spec.prompt_lookup_max, spec.max_batch) == ("ngram", 4, 4, 3)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--speculative-config", '{"method": "ngram", '
                                                        '"num_speculative_tokens": 4, "prompt_lookup_min": 2}']))
    assert config.speculative_config.num_speculative_tokens == 4 and config.speculative_config.prompt_lookup_max == 2
    assert engine_config_from_args(parser.parse_args([])).speculative_config is None


@pytest.mark.parametrize(("value", "message"), [
    ('{"method": "medusa", "model": "x", "num_speculative_tokens": 3}', "'medusa' is not built here yet"),
    ('{"method": "eagle3", "num_speculative_tokens": 3}', "the eagle3 method needs \"model\""),
    ('{"model": "org/head-eagle3", "num_speculative_tokens": 3, "prompt_lookup_min": 2}', "the eagle3 method drafts"),
    ('{"method": "ngram"}', "num_speculative_tokens must be 1 to 16"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min <= prompt_lookup_max"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "acceptance_method": "typical"}', "acceptance_method"),
    ('{"method": "lookahead", "num_speculative_tokens": 4}', "unknown method 'lookahead'"),
    ('{"num_speculative_tokens": 4}', "name a method"),
    ('{"method": "draft_model", "num_speculative_tokens": 4}', "needs \"model\": the draft's checkpoint"),
    ('{"model": "/m", "num_speculative_tokens": 4, "prompt_lookup_max": 3}', "prompt_lookup_min/max are the n-gram"),
    ('{"method": "ngram", "model": "/m", "num_speculative_tokens": 4}', "the n-gram method takes none"),
    ("ngram", "is not JSON"),
])
def test_a_config_that_cannot_run_is_refused_naming_why(value, message):
    with pytest.raises(ConfigError, match=message):
        parse_speculative_config(value)


# ---- the proposer --------------------------------------------------------------------------------


def test_the_longest_suffix_match_proposes_what_followed_it():
    ngram = NgramProposer(parse_speculative_config({**SPEC, "prompt_lookup_min": 1, "prompt_lookup_max": 3}))
    assert ngram.propose([1, 2, 3, 4, 9, 2, 3, 4, 7, 1, 2, 3], 3) == [4, 9, 2]  # "1 2 3" beats "2 3"'s later match
    assert ngram.propose([5, 6, 1, 5, 6, 2, 5, 6], 2) == [2, 5]  # among equals the latest with room after it
    assert ngram.propose([1, 2, 3], 3) == [] and ngram.propose([1, 2, 1], 0) == []
    assert NgramProposer(parse_speculative_config(SPEC)).propose([1, 2, 9, 3, 2], 4) == []  # shorter than min


# ---- the scheduler's lookahead slots ------------------------------------------------------------


def _scheduler(num_blocks: int, max_batch: int = 8) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, root_hash("m", "auto"))
    return Scheduler(kv, 8, 64, num_speculative_tokens=3, spec_max_batch=max_batch)


def _decode(scheduler: Scheduler, *request_ids: str) -> None:
    """Every request's prompt computed and a first token sampled."""
    plan = scheduler.schedule()
    scheduler.update(plan, StepResult(step_id=plan.step.step_id, sampled=[Sampled(r, 7) for r in request_ids]))


def test_decode_rows_get_lookahead_slots_within_the_budget_and_the_pool():
    scheduler = _scheduler(num_blocks=5)
    scheduler.add_request(Request("a", list(range(6)), SamplingParams(max_tokens=10), "r"))
    scheduler.add_request(Request("b", list(range(6)), SamplingParams(max_tokens=2), "r"))
    _decode(scheduler, "a", "b")  # a and b hold 2 blocks each (7 known tokens of 4 a block)
    plan = scheduler.schedule()
    rows = {row.request_id: row for row in plan.step.scheduled}
    assert rows["a"].num_lookahead == 3 and len(rows["a"].new_block_ids) == 1  # tokens 7..10: one more block
    assert rows["b"].num_lookahead == 0  # its last token is this one: nothing to draft
    assert plan.num_new_tokens == {"a": 1, "b": 1}
    # the worker accepted two drafts and sampled one more: a computed 1 + 2 tokens
    scheduler.update(plan, StepResult(step_id=plan.step.step_id, sampled=[
        Sampled("a", 8), Sampled("a", 9), Sampled("a", 10), Sampled("b", 8, FinishReason.LENGTH)]))
    a = scheduler.requests["a"]
    assert (a.num_computed_tokens, a.output_token_ids) == (9, [7, 8, 9, 10])
    scheduler.add_request(Request("c", list(range(100, 108)), SamplingParams(max_tokens=10), "r"))
    plan = scheduler.schedule()  # c's prompt takes the 2 free blocks; a's lookahead would need one more
    assert [new.request_id for new in plan.step.new_seqs] == ["c"]
    assert plan.step.scheduled[0].num_lookahead == 0 and scheduler.num_preemptions == 0  # it never preempts


def test_a_step_of_more_rows_than_the_limit_speculates_for_none():
    scheduler = _scheduler(num_blocks=32, max_batch=1)
    for r in "ab":
        scheduler.add_request(Request(r, list(range(6)), SamplingParams(max_tokens=10), "r"))
    _decode(scheduler, "a", "b")
    assert all(row.num_lookahead == 0 for row in scheduler.schedule().step.scheduled)


# ---- exact: the same tokens as without speculation ----------------------------------------------


_PLAIN: dict[str, dict] = {}  # the runs without speculation, by their model and settings: computed once


def _plain(loaded_model, prompts, **settings) -> dict:
    key = repr((id(loaded_model), sorted(settings.items())))
    if key not in _PLAIN:
        _PLAIN[key] = _run(loaded_model, prompts, None, **settings)[0]
    return _PLAIN[key]


def _run(loaded_model, prompts, speculative, num_blocks=256, budget=256, steps=1, draft=None, **sampling):
    engine = InProcessEngine(loaded_model, num_blocks=num_blocks, max_num_batched_tokens=budget,
                             num_scheduler_steps=steps, speculative=speculative, draft=draft)
    for i, p in enumerate(prompts):
        engine.add(f"r{i}", p, 48, **sampling)
    outputs = engine.run()
    assert engine.scheduler.kv.pool.num_free == num_blocks  # no block held after, lookahead ones included
    assert not engine.errors
    return outputs, engine


@pytest.mark.parametrize("case", ["greedy", "seeded", "penalties", "small-pool", "chunked", "multi-step",
                                  "greedy-deterministic"])
def test_speculation_gives_the_tokens_of_the_engine_without_it(served_model, loaded_model, prompts, case):
    """On the path `make run` serves (the C kernels), and once on --deterministic's torch ops.
    small-pool: 14 blocks, rows preempted and recomputed; chunked: prompts in chunks of 16 tokens
    beside the decoding rows; multi-step: Steps of 4 iterations, each speculating. Seeded: the draw
    at each output index is the one without speculation."""
    case, deterministic, _ = case.partition("-deterministic")
    model = loaded_model if deterministic else served_model
    sampling = {"seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 11},
                "penalties": {"temperature": 0.5, "seed": 3, "repetition_penalty": 1.05, "frequency_penalty": 0.05,
                              "min_tokens": 6}}.get(case, {})
    kwargs = {"small-pool": {"num_blocks": 14}, "chunked": {"budget": 16}, "multi-step": {"steps": 4}}.get(case, {})
    plain = _plain(model, prompts, **kwargs, **sampling)
    spec, engine = _run(model, prompts, SPEC, **kwargs, **sampling)
    assert spec == plain
    accepted = sum(d.num_accepted for d in engine.drafts)
    assert accepted > 0 and engine.drafts  # drafts were verified and some kept: the test is not vacuous
    if case == "small-pool":
        assert engine.scheduler.num_preemptions > 0


# ---- the draft_model method ----------------------------------------------------------------------


def _random_llama(folder, vocab_size: int) -> str:
    """A 2-layer Llama with random weights, saved by transformers."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return str(folder)


@pytest.fixture(scope="module")
def random_draft_path(tmp_path_factory) -> str:
    """Of SmolLM2's vocabulary: a draft that is mostly wrong, so rejections and the draft's KV
    catch-up run often."""
    return _random_llama(tmp_path_factory.mktemp("random-draft"), 49152)


@pytest.fixture(scope="module")
def random_draft(random_draft_path):
    from services.worker.backends.torch_cpu.ops import TORCH_OPS
    from services.worker.loader import load_model

    return load_model(random_draft_path, ops=TORCH_OPS)


def test_the_cpu_backend_holds_a_draft_in_the_same_blocks_and_refuses_another_vocabulary(
        default_model_path, random_draft_path, tmp_path):
    from services.worker.backends.spec import WorkerSpec
    from services.worker.backends.torch_cpu.backend import TorchCpuBackend

    budget = 64 << 20
    spec = WorkerSpec(model_path=default_model_path, kv_cache_bytes=lambda _: budget, draft_model_path=random_draft_path)
    backend = TorchCpuBackend.create(spec)
    per_block = backend.kv.bytes_per_block + backend.draft.kv.bytes_per_block  # each block holds both models' KV
    assert backend.num_blocks == backend.draft.num_blocks == budget // per_block - 1
    assert "draft model LlamaForCausalLM of 2 layers" in backend.describe().device
    spec.draft_model_path = _random_llama(tmp_path, 300)
    with pytest.raises(ConfigError, match="must be a decoder of the model's vocabulary"):
        TorchCpuBackend.create(spec)


DRAFT_SPEC = {"model": "the-draft", "num_speculative_tokens": 4, "disable_by_batch_size": 8}  # every row drafts


@pytest.mark.parametrize("case", ["self-greedy", "self-seeded", "random-greedy", "random-small-pool", "self-chunked",
                                  "self-multi-step"])
def test_a_draft_model_gives_the_tokens_of_the_engine_without_it(served_model, random_draft, prompts, case):
    """On the path `make run` serves. self: SmolLM2 drafting for itself (every draft kept: the
    draft's KV caught up two tokens at a time); random: a random draft (most rejected: its KV past
    the kept tokens recomputed)."""
    draft, _, variant = case.partition("-")
    sampling = {"seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 11}}.get(variant, {})
    kwargs = {"small-pool": {"num_blocks": 14}, "chunked": {"budget": 16}, "multi-step": {"steps": 4}}.get(variant, {})
    plain = _plain(served_model, prompts, **kwargs, **sampling)
    spec, engine = _run(served_model, prompts, DRAFT_SPEC, draft=served_model if draft == "self" else random_draft,
                        **kwargs, **sampling)
    assert spec == plain
    proposed, accepted = sum(d.num_drafted for d in engine.drafts), sum(d.num_accepted for d in engine.drafts)
    assert engine.drafts and accepted > 0
    if draft == "self" and variant == "greedy":
        assert accepted == proposed  # the model's own greedy tokens: every draft kept
    if draft == "random":
        assert accepted < proposed / 2
    if variant == "small-pool":
        assert engine.scheduler.num_preemptions > 0
