"""Images on the wire: what an image-text model takes (ImageSpec, in a worker's hello), and where a
prompt's images are (ImageRef, on a Submit and a NewSeq; their pixels in shared/bus/media.py's store)."""

from __future__ import annotations

import msgspec


class ImageSpec(msgspec.Struct, frozen=True):
    """What an image-text model makes of an image (its workers announce it): the square its vision
    tower reads, the image tokens each image takes in the prompt, and their ids."""

    size: int  # pixels a side
    num_tokens: int
    token_id: int  # each image token's (the features take its place)
    start_id: int  # the tokens that open and close an image's run
    end_id: int


class ImageRef(msgspec.Struct, frozen=True, array_like=True):
    """An image in a request's prompt: its pixels in the media store under `key` (shared/bus/media.py:
    the file's sha256 and the side it was resized to), its tokens at [offset, offset + num_tokens)."""

    key: str
    offset: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens
