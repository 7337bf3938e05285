"""BERT-style encoders against transformers: an embedder (`BertModel`, as sentence-transformers saves
them) with [CLS] and mean pooling on the worker, prompts chunked and batched beside others, and
through a stack with the openai client (/v1/embeddings, /score, /rerank; generation refused with a
400); a cross-encoder (`BertForSequenceClassification`, one label) scoring pairs, through /rerank.

Random weights saved by transformers for a shrunk BERT (2 layers, width 64, 4 heads; BERT-base's
post-norm, GELU and absolute positions kept), with a WordPiece tokenizer trained here on the test's
own sentences; the reference is transformers' BertModel: its last hidden state at [CLS], or its mean
over the prompt's tokens.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from services.worker.backends.torch_cpu.ops import TORCH_OPS
from services.worker.loader import load_model, refuse_encoder
from shared.config import ConfigError
from shared.wire.messages import Pooling

transformers = pytest.importorskip("transformers")
TEXTS = [f"Document {i}: the capital of country number {i} is city {i * 7}, by the river {i % 3}." for i in range(12)]


def _tokenizer():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(TEXTS * 4, trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return transformers.BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                                          pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")


def _save(folder, pooling: str | None):
    """A random BertModel and its tokenizer in `folder`, with sentence-transformers' pooling module
    (`pooling`: cls or mean; None: none, so [CLS] by default)."""
    torch.manual_seed(0)
    tokenizer = _tokenizer()
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128, max_position_embeddings=128)
    theirs = transformers.BertModel(config, add_pooling_layer=True).eval()
    theirs.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    if pooling is not None:
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": 64, "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False}))
    return theirs, tokenizer


def _save_cross_encoder(folder, activation: str | None = None):
    """A random one-label BertForSequenceClassification (a reranker) and its tokenizer in `folder`."""
    torch.manual_seed(0)
    tokenizer = _tokenizer()
    extra = {"sbert_ce_default_activation_function": activation} if activation else {}
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128, max_position_embeddings=128,
                                     num_labels=1, **extra)
    theirs = transformers.BertForSequenceClassification(config).eval()
    theirs.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return theirs, tokenizer


def _cross_reference(theirs, tokenizer, query: str, document: str, sigmoid: bool = True) -> float:
    pair = tokenizer(query, document, return_tensors="pt")  # token_type_ids: 1 for the document
    with torch.inference_mode():
        logit = theirs(**pair).logits[0, 0]
    return float(logit.sigmoid() if sigmoid else logit)


def _reference(theirs, ids: list[int], pooling: str) -> np.ndarray:
    with torch.inference_mode():
        states = theirs(torch.tensor([ids])).last_hidden_state[0]
    vector = states[0] if pooling == "cls" else states.mean(0)
    return torch.nn.functional.normalize(vector, dim=-1).numpy()


@pytest.mark.parametrize("pooling", ["cls", "mean", None])
def test_the_encoder_pools_as_transformers_does(tmp_path, pooling):
    theirs, tokenizer = _save(tmp_path, pooling)
    loaded = load_model(str(tmp_path), ops=TORCH_OPS)
    assert loaded.config.pooling == (pooling or "cls")
    prompts = [tokenizer.encode(t) for t in TEXTS[:5]]
    assert prompts[0][0] == tokenizer.cls_token_id and prompts[0][-1] == tokenizer.sep_token_id
    batched = torch.nn.functional.normalize(loaded.model.embed(prompts), dim=-1).numpy()  # padded to the longest
    for ids, ours in zip(prompts, batched, strict=True):
        np.testing.assert_allclose(ours, _reference(theirs, ids, pooling or "cls"), atol=1e-5)


def test_encoder_rows_chunked_and_preempted_give_their_lone_vectors(tmp_path):
    """56-token prompts in chunks of at most 24, in a pool too small for two: the worker encodes
    each whole at its last chunk, and every vector is its lone run's and transformers'."""
    from tests.inproc_engine import InProcessEngine
    from tests.model_helpers import make_runner

    theirs, tokenizer = _save(tmp_path, "mean")
    loaded = load_model(str(tmp_path), ops=TORCH_OPS)
    prompts = [tokenizer.encode(" ".join(TEXTS[i : i + 3])) for i in range(5)]
    assert min(map(len, prompts)) > 24
    # 5 blocks of 16: a 56-token prompt takes 4, so a second one's chunks preempt the first
    engine = InProcessEngine(loaded, num_blocks=5, max_num_batched_tokens=24, runner=make_runner(loaded, 5))
    for i, ids in enumerate(prompts):
        engine.add(f"r{i}", ids, 1, pooling=Pooling())
    engine.run()
    assert engine.scheduler.num_preemptions > 0
    for i, ids in enumerate(prompts):
        assert engine.outputs[f"r{i}"] == []
        ours = np.frombuffer(engine.embeddings[f"r{i}"], dtype="<f4")
        np.testing.assert_allclose(ours, _reference(theirs, ids, "mean"), atol=1e-5)


@pytest.mark.parametrize("activation", [None, "torch.nn.modules.linear.Identity"])
def test_a_cross_encoder_scores_pairs_as_transformers_does(tmp_path, activation):
    """Each (query, document) pair read together, the document as segment 1: the sigmoid of the
    classifier's logit (or the logit, where sentence-transformers' config says Identity)."""
    from shared.models.tokenizer import load_tokenizer

    theirs, tokenizer = _save_cross_encoder(tmp_path, activation)
    loaded = load_model(str(tmp_path), ops=TORCH_OPS)
    ours = load_tokenizer(str(tmp_path))
    pairs = [(TEXTS[0], TEXTS[i]) for i in range(1, 6)]
    prompts = [ours.encode_pair(q, d) for q, d in pairs]
    assert prompts[0] == tokenizer(*pairs[0])["input_ids"]
    scores = loaded.model.embed(prompts)[:, 0].tolist()  # batched, padded to the longest
    for (q, d), score in zip(pairs, scores, strict=True):
        assert score == pytest.approx(_cross_reference(theirs, tokenizer, q, d, activation is None), abs=1e-5)

def test_the_paged_backends_refuse_an_encoder_by_name(tmp_path):
    from services.worker.backends.qaic.backend import QaicBackend
    from services.worker.backends.spec import WorkerSpec
    from shared.control.deploy_config import QaicConfig

    _save(tmp_path, None)
    spec = WorkerSpec(model_path=str(tmp_path), kv_cache_bytes=lambda _: 0,
                      qaic=QaicConfig(full_batch_size=4, ctx_len=128, prefill_seq_len=32)).with_dtype_for("qaic")
    with pytest.raises(ConfigError, match=r"BertModel is an encoder .*\(--device cpu\), not on qaic"):
        QaicBackend.create(spec)  # the emulator, on this CPU
    with pytest.raises(ConfigError, match=r"BertModel is an encoder .*\(--device cpu\), not on cuda"):
        refuse_encoder(load_model(str(tmp_path), ops=TORCH_OPS), "cuda")  # what CudaBackend.create calls once its GPU is found


@pytest.mark.stack
def test_an_encoder_through_the_stack(tmp_path_factory):
    """Served by `make run`'s services on their defaults: embeddings with the openai client within
    1e-4 cosine of transformers, /score and /rerank by them, and generation refused by name."""
    import httpx
    import openai

    from tests.conftest import _start_stack

    folder = tmp_path_factory.mktemp("bert-model")
    theirs, tokenizer = _save(folder, "mean")
    stack = _start_stack(tmp_path_factory, "bert", 1, ["--model-path", str(folder), "--model", "bert",
                                                       "--no-deterministic"])
    try:
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)
        expected = [_reference(theirs, tokenizer.encode(t), "mean") for t in TEXTS]
        got = client.embeddings.create(model="bert", input=TEXTS)
        for d, e in zip(got.data, expected, strict=True):
            assert float(np.dot(d.embedding, e)) > 1 - 1e-4
        assert got.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)  # [CLS] and [SEP] counted
        models = httpx.get(stack.base_url + "/v1/models").json()["data"]
        assert models[0]["architectures"] == ["BertModel"]
        ranked = httpx.post(stack.base_url + "/v1/rerank", json={
            "model": "bert", "query": TEXTS[0], "documents": TEXTS[1:6], "top_n": 2}).json()
        cosines = [float(np.dot(expected[0], e)) for e in expected[1:6]]
        assert [r["index"] for r in ranked["results"]] == sorted(range(5), key=lambda i: -cosines[i])[:2]
        for call in (lambda: client.completions.create(model="bert", prompt="Hello", max_tokens=4),
                     lambda: client.chat.completions.create(model="bert", messages=[{"role": "user", "content": "Hi"}])):
            with pytest.raises(openai.BadRequestError, match="does not support generation: it is an encoder"):
                call()
        too_long = httpx.post(stack.base_url + "/v1/embeddings", json={"model": "bert", "input": [[5] * 200]})
        assert too_long.status_code == 400 and "maximum context length is 128" in too_long.json()["error"]["message"]
    finally:
        stack.stop()


@pytest.mark.stack
def test_a_cross_encoder_reranks_through_the_stack(tmp_path_factory):
    """/rerank and /score by the pairs' scores (transformers' within 1e-4), embeddings refused."""
    import httpx

    from tests.conftest import _start_stack

    folder = tmp_path_factory.mktemp("reranker-model")
    theirs, tokenizer = _save_cross_encoder(folder)
    stack = _start_stack(tmp_path_factory, "reranker", 1, ["--model-path", str(folder), "--model", "rerank",
                                                           "--no-deterministic"])
    try:
        expected = [_cross_reference(theirs, tokenizer, TEXTS[0], d) for d in TEXTS[1:7]]
        ranked = httpx.post(stack.base_url + "/v1/rerank", json={
            "model": "rerank", "query": TEXTS[0], "documents": TEXTS[1:7], "top_n": 3}).json()
        assert [r["index"] for r in ranked["results"]] == sorted(range(6), key=lambda i: -expected[i])[:3]
        for r in ranked["results"]:
            assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-4)
        scored = httpx.post(stack.base_url + "/score", json={"model": "rerank", "text_1": TEXTS[0],
                                                            "text_2": TEXTS[1:3]}).json()
        assert [d["score"] for d in scored["data"]] == pytest.approx(expected[:2], abs=1e-4)
        refused = httpx.post(stack.base_url + "/v1/embeddings", json={"model": "rerank", "input": "x"})
        assert refused.status_code == 400 and "is a cross-encoder" in refused.json()["error"]["message"]
    finally:
        stack.stop()
