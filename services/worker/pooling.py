"""An embedding from a prompt's pooled hidden state: Matryoshka truncation, L2 norm, float32 bytes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.wire.messages import Pooling


def pool(hidden: torch.Tensor, pooling: Pooling) -> bytes:
    """A prompt's pooled state [hidden] (a decoder's last token's, an encoder's [CLS] or mean) -> its
    embedding: the first `dimensions` values (Matryoshka), L2-normalized where asked, as float32 bytes."""
    vector = hidden.float()[: pooling.dimensions]
    if pooling.normalize:
        vector = F.normalize(vector, dim=-1)
    return vector.cpu().numpy().astype("<f4").tobytes()
