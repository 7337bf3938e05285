"""The product's BYOP interface (`mac`), which a custom runtime's script extends: Inference or
AsyncInference for predict, InferenceBuilder to create it from a CustomInferenceConfig."""
