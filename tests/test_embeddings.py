"""Embeddings (last-token pooling of a decoder, as Qwen3-Embedding pools) against transformers, on the
worker's path and through a stack: /v1/embeddings with the official openai client (float and
base64, many inputs batched, Matryoshka `dimensions`), /score and /rerank.

Random weights saved by transformers for Qwen3-Embedding-0.6B's geometry (query and KV heads, head
size, rope theta; width, depth and vocabulary shrunk), with SmolLM2's tokenizer; the reference is
transformers' Qwen3Model: the final norm's output at the last prompt token, L2-normalized (what
sentence-transformers' last-token pooling and Normalize modules compute).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.backends.torch_cpu.ops import TORCH_OPS
from services.worker.loader import load_model
from shared.wire.messages import NewSeq, Pooling, SamplingParams, ScheduledSeq, Step
from tests.model_helpers import make_runner

transformers = pytest.importorskip("transformers")
QWEN3_EMBEDDING = dict(hidden_size=256, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=32768,
                       intermediate_size=512, num_hidden_layers=2, initializer_range=0.08)


def _reference(model, ids: list[int], dimensions: int | None = None) -> np.ndarray:
    with torch.inference_mode():
        last = model.model(torch.tensor([ids])).last_hidden_state[0, -1, :dimensions]
    return torch.nn.functional.normalize(last.float(), dim=-1).numpy()


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=2048, **QWEN3_EMBEDDING)
    theirs = transformers.Qwen3ForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("qwen3-embedding")
    theirs.save_pretrained(folder, safe_serialization=True)
    return theirs, load_model(str(folder), ops=TORCH_OPS)


def _pooled_seq(request_id: str, ids: list[int], num_new: int, pooling: Pooling, first_block: int) -> NewSeq:
    blocks = list(range(first_block, first_block + -(-len(ids) // 16)))
    return NewSeq(request_id=request_id, token_ids=ids, num_prompt_tokens=len(ids), num_computed_tokens=0,
                  num_new_tokens=num_new, block_ids=blocks, reply_to="",
                  sampling=SamplingParams(max_tokens=1, pooling=pooling))


def test_the_worker_pools_the_last_hidden_state_as_transformers_does(embedder):
    """Alone, in chunks, and batched beside a generating row: the same vector, transformers' to 1e-5."""
    theirs, ours = embedder
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2048, (70,), generator=gen).tolist()
    expected = _reference(theirs, ids)

    runner = make_runner(ours, num_blocks=32)
    out = runner.execute(Step(step_id=0, new_seqs=[_pooled_seq("a", ids, 70, Pooling(), 0)]))
    assert [(s.request_id, s.token_id, s.finish_reason.name) for s in out.sampled] == [("a", -1, "STOP")]
    alone = np.frombuffer(out.embeddings["a"], dtype="<f4")
    np.testing.assert_allclose(alone, expected, atol=1e-5)
    assert not runner.seqs  # finished with its embedding

    # chunked (30 tokens, then 40) beside a generating row: nothing is sampled for it until its last chunk
    other = NewSeq(request_id="g", token_ids=ids[:20], num_prompt_tokens=20, num_computed_tokens=0,
                   num_new_tokens=20, block_ids=[10, 11], reply_to="", sampling=SamplingParams(max_tokens=4))
    out = runner.execute(Step(step_id=1, new_seqs=[_pooled_seq("b", ids, 30, Pooling(), 0), other]))
    assert [s.request_id for s in out.sampled] == ["g"] and not out.embeddings
    out = runner.execute(Step(step_id=2, scheduled=[ScheduledSeq("b", 40, 30), ScheduledSeq("g", 1, 20)]))
    np.testing.assert_allclose(np.frombuffer(out.embeddings["b"], dtype="<f4"), alone, atol=1e-6)
    assert {s.request_id for s in out.sampled} == {"b", "g"}

    # Matryoshka: the first 64 values, normalized after the cut
    out = runner.execute(Step(step_id=3, new_seqs=[_pooled_seq("c", ids, 70, Pooling(dimensions=64), 0)]))
    np.testing.assert_allclose(np.frombuffer(out.embeddings["c"], dtype="<f4"), _reference(theirs, ids, 64),
                               atol=1e-5)


@pytest.mark.stack
def test_embeddings_scores_and_reranking_through_the_stack(tmp_path_factory, hf_tokenizer):
    """A random Qwen3-Embedding-shaped directory (Matryoshka-trained, as its config says) served by
    `make run`'s services on their defaults, asked through the openai client and plain HTTP."""
    import base64

    import httpx
    import openai

    from tests.model_helpers import serve_checkpoint

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=len(hf_tokenizer), is_matryoshka=True, **QWEN3_EMBEDDING,
                                      eos_token_id=hf_tokenizer.eos_token_id, bos_token_id=hf_tokenizer.bos_token_id)
    theirs = transformers.Qwen3ForCausalLM(config).eval()
    stack = serve_checkpoint(tmp_path_factory, "embed", theirs, hf_tokenizer, "--max-model-len", "512")
    try:
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused")
        texts = [f"Document {i}: the capital of country number {i} is city {i * 7}." for i in range(12)]
        expected = [_reference(theirs, hf_tokenizer.encode(t)) for t in texts]
        # the client asks for base64 and decodes it; twelve inputs go to the engine together
        got = client.embeddings.create(model="embed", input=texts)
        assert [d.index for d in got.data] == list(range(12))
        for d, e in zip(got.data, expected, strict=True):
            assert float(np.dot(d.embedding, e)) > 1 - 1e-4  # cosine, both unit vectors
        assert got.usage.prompt_tokens == sum(len(hf_tokenizer.encode(t)) for t in texts)
        as_floats = httpx.post(stack.base_url + "/v1/embeddings", json={
            "model": "embed", "input": texts[0], "encoding_format": "float"}).json()
        np.testing.assert_allclose(as_floats["data"][0]["embedding"], got.data[0].embedding, atol=1e-7)
        as_b64 = httpx.post(stack.base_url + "/v1/embeddings", json={
            "model": "embed", "input": [hf_tokenizer.encode(texts[1])], "encoding_format": "base64"}).json()
        decoded = np.frombuffer(base64.b64decode(as_b64["data"][0]["embedding"]), dtype="<f4")
        np.testing.assert_allclose(decoded, expected[1], atol=1e-4)
        short = client.embeddings.create(model="embed", input=texts[2], dimensions=32)
        assert len(short.data[0].embedding) == 32
        assert float(np.dot(short.data[0].embedding, _reference(theirs, hf_tokenizer.encode(texts[2]), 32))) > 1 - 1e-4
        raw = httpx.post(stack.base_url + "/v1/embeddings", json={
            "model": "embed", "input": texts[3], "encoding_format": "float", "normalize": False}).json()
        with torch.inference_mode():
            hidden = theirs.model(torch.tensor([hf_tokenizer.encode(texts[3])])).last_hidden_state[0, -1].numpy()
        np.testing.assert_allclose(raw["data"][0]["embedding"], hidden, atol=1e-4)  # vLLM's normalize=false
        too_wide = httpx.post(stack.base_url + "/v1/embeddings", json={"model": "embed", "input": "x",
                                                                       "dimensions": 1000})
        assert too_wide.status_code == 400 and "matryoshka" in too_wide.json()["error"]["message"]
        empty = httpx.post(stack.base_url + "/v1/embeddings", json={"model": "embed", "input": []})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"
        too_many = httpx.post(stack.base_url + "/v1/embeddings", json={"model": "embed", "input": ["a"] * 2049})
        assert too_many.status_code == 400 and "at most 2048" in too_many.json()["error"]["message"]
        too_long = httpx.post(stack.base_url + "/v1/embeddings", json={"model": "embed", "input": [[5] * 600]})
        assert too_long.status_code == 400 and "maximum context length is 512" in too_long.json()["error"]["message"]

        # /score: cosine similarities, one text_1 against each text_2
        scored = httpx.post(stack.base_url + "/score", json={
            "model": "embed", "text_1": texts[0], "text_2": texts[1:4]}).json()
        assert [d["index"] for d in scored["data"]] == [0, 1, 2]
        for d, e in zip(scored["data"], expected[1:4], strict=True):
            assert d["object"] == "score" and d["score"] == pytest.approx(float(np.dot(expected[0], e)), abs=1e-4)
        # /rerank (Cohere's and Jina's shape): sorted by relevance, top_n kept
        ranked = httpx.post(stack.base_url + "/v1/rerank", json={
            "model": "embed", "query": texts[0], "documents": texts[1:6], "top_n": 3}).json()
        cosines = [float(np.dot(expected[0], e)) for e in expected[1:6]]
        assert [r["index"] for r in ranked["results"]] == sorted(range(5), key=lambda i: -cosines[i])[:3]
        assert ranked["results"][0]["document"]["text"] == texts[1 + ranked["results"][0]["index"]]
        assert ranked["results"][0]["relevance_score"] == pytest.approx(max(cosines), abs=1e-4)
    finally:
        stack.stop()


@pytest.mark.stack
def test_a_model_not_matryoshka_trained_refuses_dimensions(openai_client, model_name):
    """The default stack's SmolLM2 (a GGUF: nothing says Matryoshka): vLLM's words, a 400."""
    import openai

    whole = openai_client.embeddings.create(model=model_name, input="Paris is in France.")
    assert len(whole.data[0].embedding) == 576 and abs(np.linalg.norm(whole.data[0].embedding) - 1) < 1e-5
    with pytest.raises(openai.BadRequestError, match="does not support matryoshka representation"):
        openai_client.embeddings.create(model=model_name, input="Paris", dimensions=64)


def test_pooling_rows_among_generating_ones_through_the_scheduler(embedder):
    """Embedding requests beside generating ones, sharing a prefix, in a pool too small for all: each
    embedding is its lone run's, each generation its lone run's, and the scheduler adds no token to
    a pooling request."""
    from tests.inproc_engine import InProcessEngine

    _, ours = embedder
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 2048, (40,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 2048, (10 + 9 * i,), generator=gen).tolist() for i in range(6)]

    def run(requests: list[tuple[str, list[int], bool]], num_blocks: int) -> InProcessEngine:
        engine = InProcessEngine(ours, num_blocks=num_blocks, max_num_batched_tokens=48)
        for request_id, ids, pooled in requests:
            if pooled:
                engine.add(request_id, ids, 1, pooling=Pooling())
            else:
                engine.add(request_id, ids, 24, min_tokens=24)
        engine.run()
        return engine

    mixed = [(f"r{i}", p, i % 2 == 0) for i, p in enumerate(prompts)]
    together = run(mixed, num_blocks=16)
    assert together.scheduler.num_preemptions > 0 and max(together.num_cached_tokens.values()) >= 32
    for request_id, ids, pooled in mixed:
        alone = run([(request_id, ids, pooled)], num_blocks=16)
        if pooled:
            assert together.outputs[request_id] == []
            np.testing.assert_allclose(np.frombuffer(together.embeddings[request_id], dtype="<f4"),
                                       np.frombuffer(alone.embeddings[request_id], dtype="<f4"), atol=1e-6)
        else:
            assert together.outputs[request_id] == alone.outputs[request_id]


def test_pooling_on_the_qaic_slots(small_qwen3, tmp_path, monkeypatch):
    """A QAIC worker's fixed shapes pool what the torch path pools: a slot freed at the prompt's end."""
    from services.scheduler.slot_manager import SlotManager
    from services.scheduler.slot_scheduler import SlotScheduler
    from services.worker.model_runner import ModelRunner
    from tests.inproc_engine import InProcessEngine
    from tests.qaic.test_qaic_backend import CHUNK, CTX_LEN, SLOTS, qaic_backend

    monkeypatch.setenv("SWITCHYARD_CACHE", str(tmp_path / "cache"))
    backend = qaic_backend(small_qwen3)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 299, (n,), generator=gen).tolist() for n in (40, 3, 17, 30, 9)]
    runner = ModelRunner(backend, max_model_len=CTX_LEN, eos_token_ids=backend.config.eos_token_ids)
    slots = InProcessEngine(backend, num_blocks=16, runner=runner,
                            scheduler=SlotScheduler(SlotManager(SLOTS, CTX_LEN), CHUNK))
    paged = InProcessEngine(load_model(small_qwen3, "dummy", ops=TORCH_OPS), num_blocks=64)
    for engine in (slots, paged):
        for i, ids in enumerate(prompts):
            engine.add(f"r{i}", ids, 1, pooling=Pooling(dimensions=16))
        engine.run()
    assert sorted(slots.embeddings) == [f"r{i}" for i in range(5)]
    for request_id, vector in paged.embeddings.items():
        np.testing.assert_allclose(np.frombuffer(slots.embeddings[request_id], dtype="<f4"),
                                   np.frombuffer(vector, dtype="<f4"), atol=1e-5)


@pytest.mark.stack
def test_langchain_and_litellm_embeddings(stack, model_name, openai_client):
    """LangChain's OpenAIEmbeddings (its own tiktoken split turned off, as for any server whose model
    is not OpenAI's: vLLM's advice too) and LiteLLM's embedding(), both providers: the openai client's
    vectors, in input order."""
    import litellm
    from langchain_openai import OpenAIEmbeddings

    texts = ["Paris is the capital of France.", "Rome is the capital of Italy.", "Bananas are yellow."]
    expected = [d.embedding for d in openai_client.embeddings.create(model=model_name, input=texts).data]
    lc = OpenAIEmbeddings(model=model_name, base_url=stack.base_url + "/v1", api_key="unused",
                          check_embedding_ctx_length=False, max_retries=0)
    np.testing.assert_allclose(lc.embed_documents(texts), expected, atol=1e-6)
    np.testing.assert_allclose(lc.embed_query(texts[2]), expected[2], atol=1e-6)
    for provider in ("openai", "hosted_vllm"):
        got = litellm.embedding(model=f"{provider}/{model_name}", input=texts, api_base=stack.base_url + "/v1",
                                api_key="unused")
        np.testing.assert_allclose([d["embedding"] for d in got.data], expected, atol=1e-6)
