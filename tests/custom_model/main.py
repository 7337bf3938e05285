"""A custom vLLM runtime as the product's continuous-batching guide writes one (its builder word
for word), with a predict that answers the records route's row; `tabulate` is a requirement."""

import uuid

import numpy as np
from mac.config.inference import CustomInferenceConfig
from mac.inference import AsyncInference
from mac.inference.creation import InferenceBuilder
from mac.types import InferenceData
from tabulate import tabulate

# vllm import libraries
from vllm import AsyncLLMEngine, SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs


class AsyncVLLMInference(AsyncInference):
    @property
    def expected_model_types(self) -> set:
        return {AsyncLLMEngine}

    async def _predict(self, input_data: InferenceData) -> InferenceData:
        prompt, max_tokens = str(input_data["prompt"][0]), int(input_data["max_tokens"][0])
        print(tabulate([[prompt, max_tokens]], headers=["prompt", "max_tokens"]))
        final = None
        async for output in self.model.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                                uuid.uuid4().hex):
            final = output
        return {"generated_text": np.array([final.outputs[0].text]),
                "num_output_tokens": np.array([len(final.outputs[0].token_ids)])}


class AsyncVLLMInferenceBuilder(InferenceBuilder):
    """Inference builder class for AsyncVLLMInference."""

    def inference(self) -> AsyncVLLMInference: # extend mac.inference.AsyncInference
        """Returns an Inference subclass instance.
        This specifies the Inference instance to be used
        by create() to build additionally needed components."""
        return AsyncVLLMInference()

    def create(self, config: CustomInferenceConfig) -> AsyncVLLMInference:
        """Creates an Inference subclass and assigns a model to it.
        :param config: Inference configuration
        :return: Inference subclass
        """
        inference = self.inference
        inference.model = AsyncLLMEngine.from_engine_args(
            AsyncEngineArgs(
                model=(config.model_path / "model").as_posix(),
            ),
        )
        return inference
