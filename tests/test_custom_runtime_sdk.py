"""The custom runtime's SDK names (`mac`, `vllm`) and artifact rules, without a stack: what is
refused by name, and the product's guide's builder written as it is there."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "services" / "custom_runtime" / "sdk"))

from mac.inference import AsyncInference  # noqa: E402
from mac.inference.creation import InferenceBuilder  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402

from services.custom_runtime.predictor import columns, records  # noqa: E402
from shared.models.custom_artifact import requirements_in  # noqa: E402


def test_what_the_engine_does_not_carry_out_is_refused_by_name():
    with pytest.raises(TypeError, match="best_of, use_beam_search not supported"):
        SamplingParams(max_tokens=4, best_of=2, use_beam_search=True)
    with pytest.raises(ValueError, match="n = 2"):
        SamplingParams(n=2)
    assert SamplingParams(stop="\n").stop == ["\n"]
    with pytest.raises(TypeError, match="dtype, tensor_parallel_size: set these in the model's framework_config"):
        AsyncEngineArgs(model="/m", dtype="half", tensor_parallel_size=2)


def test_the_guides_builder_with_inference_as_a_plain_method_works_as_written():
    class Echo(AsyncInference):
        @property
        def expected_model_types(self) -> set:
            return {str}

    class Builder(InferenceBuilder):
        def inference(self) -> Echo:  # no @property, as the product's guide writes it
            return Echo()

        def create(self, config) -> Echo:
            inference = self.inference
            inference.model = "an engine"
            return inference

    assert Builder().create(None).model == "an engine"
    with pytest.raises(TypeError, match="Echo.model must be one of str, got int"):
        Echo().model = 3


def test_requirements_less_what_switchyard_serves_options_refused(tmp_path):
    (tmp_path / "requirements.txt").write_text("# pinned\nvllm==0.6.6\ntabulate==0.9.0  # tables\n\nWallaroo>=1\n")
    assert requirements_in(tmp_path) == ["tabulate==0.9.0"]
    (tmp_path / "requirements.txt").write_text("-r other.txt\n")
    with pytest.raises(ValueError, match="line 1: '-r other.txt': options are not taken"):
        requirements_in(tmp_path)
    (tmp_path / "requirements.txt").write_text("tabulate>>1\n")
    with pytest.raises(ValueError, match="line 1: .tabulate>>1. is not a requirement"):
        requirements_in(tmp_path)


def test_rows_become_columns_and_back():
    data = columns([{"prompt": "a", "max_tokens": 2}])
    assert data["prompt"].tolist() == ["a"] and data["max_tokens"].dtype.kind == "i"
    assert records({"generated_text": np.array(["x"]), "num_output_tokens": np.array([1])}) == [
        {"generated_text": "x", "num_output_tokens": 1}]
    with pytest.raises(ValueError, match="different lengths"):
        records({"a": [1, 2], "b": [1]})
