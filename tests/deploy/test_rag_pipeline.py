"""The seed product's RAG pattern through the SDK: an embedder step, then the LLM, in one pipeline.
Each step deploys as a pipeline of its own (`<name>-step<i>`); the pipeline's URL answers
embeddings and reranking with its first step and chat with its last; status reports both steps;
undeploy takes both down. The embedder is a random BERT saved by transformers (tests/
test_bert_embeddings.py), the LLM the default SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.config import DeploymentConfigBuilder

pytestmark = pytest.mark.stack


def test_an_embedder_step_then_the_llm_deploy_and_answer_as_one_pipeline(wl, smollm2, tmp_path):
    pytest.importorskip("transformers")
    from tests.test_bert_embeddings import TEXTS, _reference, _save

    (tmp_path / "embedder").mkdir()
    theirs, tokenizer = _save(tmp_path / "embedder", "mean")
    embedder = wl.upload_model("tiny-embedder", str(tmp_path / "embedder"))
    assert embedder.record["architecture"] == "BertModel"
    config = DeploymentConfigBuilder().sidekick_cpus(embedder, 1).sidekick_memory(embedder, "512Mi") \
        .sidekick_cpus(smollm2, 1).sidekick_memory(smollm2, "1Gi").build()
    rag = wl.build_pipeline("rag").clear().add_model_step(embedder).add_model_step(smollm2)
    rag.deploy(deployment_config=config)
    try:
        status = rag.status()
        assert status["status"] == "Running"
        assert [(s["pipeline"], s["status"]) for s in status["steps"]] == [("rag-step1", "Running"),
                                                                             ("rag-step2", "Running")]
        assert [m["name"] for m in status["models"]] == ["tiny-embedder", "smollm2"]
        assert len(status["sidekicks"]) >= 2  # a worker of each step

        # retrieval: the documents and the question embedded through the pipeline, as transformers would
        client = rag.openai_client()
        documents = TEXTS[:6]
        vectors = np.array([d.embedding for d in client.embeddings.create(model=rag.deployment, input=documents).data])
        for ours, text in zip(vectors, documents, strict=True):
            assert float(np.dot(ours, _reference(theirs, tokenizer.encode(text), "mean"))) > 1 - 1e-4
        question = client.embeddings.create(model=rag.deployment, input=TEXTS[4]).data[0].embedding
        best = int(np.argmax(vectors @ np.array(question)))
        assert best == 4
        ranked = wl.http.post(rag.url() + "/openai/v1/rerank", json={"query": TEXTS[4], "documents": documents})
        assert ranked.status_code == 200 and ranked.json()["results"][0]["index"] == 4

        # generation: the retrieved context in the LLM step's chat
        reply = rag.openai_chat_completion(messages=[{"role": "user", "content": f"Context: {documents[best]}\n"
                                                      "Question: which city is the capital?"}],
                                           max_tokens=8, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 8 and reply.model == status["steps"][1]["deployment"]
        records = wl.http.post(rag.url(), json=[{"prompt": "Hello", "max_tokens": 4}])
        assert records.status_code == 400 and "several steps" in records.json()["error"]["message"]
        step = wl.http.post(wl.api_endpoint + "/v1/api/pipelines/deploy", json={"pipeline": "rag-step1"})
        assert step.status_code == 400 and "is a step of 'rag'" in step.json()["error"]["message"]
    finally:
        rag.undeploy()
    assert rag.status()["status"] == "Undeployed"
    for name in ("rag-step1", "rag-step2"):
        assert wl.get_pipeline(name).record["deployed"] is False
