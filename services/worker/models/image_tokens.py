"""What an image-text model's language model does with images: its image tokens' embeddings are
replaced by the image encoder's features (`image_embeds`, set for a step by the backend)."""

from __future__ import annotations

import torch


class ImageTokens:
    """A mixin before the language model's class (it overrides `embed`)."""

    image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows of the batch, their features)
    images_see_both_ways = False  # an image's tokens attend to each other both ways in a prefill (Gemma 3)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        if self.image_embeds is not None:
            rows, features = self.image_embeds
            x = x.index_copy(0, rows, features.to(x.dtype))
        return x
