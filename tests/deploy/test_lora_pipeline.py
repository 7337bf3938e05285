"""A LoRA adapter through the SDK: uploaded as a version of its base model (`lora_base`), added to
the base's pipeline (it joins the base's step), deployed with it, and served beside it by its own
name, on the pipeline's URL and the gateway's; the adapter's text is transformers' with PEFT's
merged weights. Random adapter saved by peft for SmolLM2's shapes."""

from __future__ import annotations

import pytest

from switchyard import SwitchyardError
from switchyard.config import DeploymentConfigBuilder

pytestmark = pytest.mark.stack
peft = pytest.importorskip("peft")


def test_an_adapter_uploaded_as_a_version_of_its_base_serves_beside_it(wl, smollm2, hf_model, hf_tokenizer,
                                                                        tmp_path):
    from tests.test_lora_stack import ALL, NUM_TOKENS, PROMPT, _save, merged_text

    _save(hf_model, tmp_path / "sql", 8, ALL, False, 0)
    adapter = wl.upload_model("smollm2-sql", str(tmp_path / "sql"), lora_base=smollm2)
    assert adapter.status == "ready" and adapter.record["lora_rank"] == 8
    assert adapter.record["lora_base"] == {"model": "smollm2", "version": smollm2.version}
    with pytest.raises(SwitchyardError, match="add that model's step to the pipeline first"):
        wl.build_pipeline("lonely-adapter").clear().add_model_step(adapter)
    with pytest.raises(SwitchyardError, match="lora_base"):
        wl.upload_model("orphan", str(tmp_path / "sql"), lora_base=adapter)  # an adapter of an adapter

    tuned = wl.build_pipeline("tuned").clear().add_model_step(smollm2).add_model_step(adapter)
    assert [s["model"] for s in tuned.record["steps"]] == ["smollm2"]
    assert tuned.record["loras"] == [{"model": "smollm2-sql", "version": adapter.version}]
    tuned.deploy(deployment_config=DeploymentConfigBuilder().sidekick_cpus(smollm2, 1)
                 .sidekick_memory(smollm2, "1Gi").build())
    try:
        client = tuned.openai_client()  # the pipeline's URL: its model, or one of its adapters by name
        answers = {name: client.completions.create(model=name, prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0,
                                                   extra_body={"ignore_eos": True})
                   for name in ("smollm2-sql", tuned.deployment)}
        assert answers["smollm2-sql"].model == "smollm2-sql"
        assert answers["smollm2-sql"].choices[0].text == merged_text(hf_model, hf_tokenizer, str(tmp_path / "sql"))
        assert answers[tuned.deployment].choices[0].text == merged_text(hf_model, hf_tokenizer, None)
        listed = {m["id"]: m for m in wl.http.get(wl.api_endpoint + "/v1/models").json()["data"]}
        assert listed["smollm2-sql"]["parent"] == tuned.deployment
    finally:
        tuned.undeploy()
