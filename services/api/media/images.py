"""An image part's bytes -> a checked picture (PNG, JPEG or WebP, within a pixel budget), and the
pixels a model's vision tower takes, resized here so that the workers' cores run only the model."""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

from PIL import Image

from services.api.media.fetch import MediaError

FORMATS = {"PNG": "PNG", "JPEG": "JPEG", "WEBP": "WebP"}
MAX_PIXELS = 8192 * 8192  # past this a file is refused before it is decoded (a decompression bomb)


@dataclass(frozen=True)
class Picture:
    image: Image.Image  # RGB, decoded
    digest: str  # sha256 of the file's bytes: two parts with the same file are the same image

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size


def decode(data: bytes, max_pixels: int = MAX_PIXELS) -> Picture:
    """The file's header is read first: its format and size are checked before its pixels are."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format not in FORMATS:
                raise MediaError(f"an image of format {image.format or 'unknown'} is not accepted "
                                 f"({', '.join(FORMATS.values())})")
            width, height = image.size
            if width * height > max_pixels:
                raise MediaError(f"the image is {width}x{height}: it would decode to more than the {max_pixels} "
                                 "pixels the gateway decodes")
            image.load()
            return Picture(image=image.convert("RGB"), digest=hashlib.sha256(data).hexdigest())
    except MediaError:
        raise
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise MediaError(f"the image would decode to more than the {max_pixels} pixels the gateway decodes "
                         f"({exc})") from None
    except Image.UnidentifiedImageError:
        raise MediaError("the data is not an image (PNG, JPEG or WebP)") from None
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt
        raise MediaError(f"the image cannot be decoded: {exc}") from None


RESAMPLE = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}


def resized_pixels(picture: Picture, width: int, height: int, resample: str = "bilinear",
                   box: tuple[int, int, int, int] | None = None) -> bytes:
    """RGB bytes, row-major, width x height: the picture (or its crop `box`) resized as the model's
    image processor does (Gemma 3's bilinearly, Qwen2.5-VL's bicubically; their normalizations are the worker's)."""
    image = picture.image if box is None else picture.image.crop(box)
    return image.resize((width, height), RESAMPLE[resample]).tobytes()
