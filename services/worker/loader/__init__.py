"""Model loading: GGUF file, Hugging Face directory, or random weights for a config (`dummy`)."""

from services.worker.loader.load import LoadedModel, load_model, refuse_encoder, refuse_images

__all__ = ["LoadedModel", "load_model", "refuse_encoder", "refuse_images"]
