"""The gateway's image inputs (services/api/media): data URLs and http(s) URLs served by a real local
HTTP server, files written by Pillow; every refusal says why, and nothing private is fetched unless allowed."""

from __future__ import annotations

import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from services.api.media.fetch import MediaError, MediaPolicy, fetch
from services.api.media.images import decode, resized_pixels

LOCAL = MediaPolicy(allow_private=True, timeout_s=2.0, max_bytes=2**20)


def image_bytes(fmt: str, size=(37, 53), seed: int = 0) -> bytes:
    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def http_server():
    """Routes: /cat.png (a PNG), /big (past the size cap), /moved (a redirect to /cat.png),
    /slow (never answers in time), /missing (404)."""
    png = image_bytes("PNG")
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", "/cat.png")
                self.end_headers()
                return
            if self.path == "/slow":
                release.wait(10)
            body = {"/cat.png": png, "/big": b"\0" * (2**20 + 1), "/slow": png}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            try:
                self.wfile.write(body or b"")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stopped reading past its cap (/big): as it should

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", png
    release.set()
    server.shutdown()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
async def test_a_data_url_of_each_format_decodes(fmt):
    data = image_bytes(fmt)
    picture = decode(await fetch(data_url(data, f"image/{fmt.lower()}"), LOCAL))
    assert picture.size == (37, 53) and picture.image.mode == "RGB"


async def test_an_http_url_and_its_redirect_give_the_file(http_server):
    base, png = http_server
    assert await fetch(f"{base}/cat.png", LOCAL) == png
    assert await fetch(f"{base}/moved", LOCAL) == png


async def test_a_private_address_is_refused_unless_allowed(http_server):
    base, _ = http_server
    with pytest.raises(MediaError, match="private address .*--allow-private-media-urls"):
        await fetch(f"{base}/cat.png", MediaPolicy())
    with pytest.raises(MediaError, match="private address"):  # a name that resolves to one, too
        await fetch(base.replace("127.0.0.1", "localhost") + "/cat.png", MediaPolicy())


@pytest.mark.parametrize("path, policy, error", [
    ("/big", LOCAL, r"larger than 1048576 bytes \(--max-media-bytes\)"),
    ("/slow", MediaPolicy(allow_private=True, timeout_s=0.3), r"more than 0.3s \(--media-fetch-timeout-s\)"),
    ("/missing", LOCAL, "answered HTTP 404"),
    ("/cat.png", MediaPolicy(allow_private=True, allowed_domains=("example.com",)), "not among --allowed-media-domains"),
], ids=["too-big", "too-slow", "not-found", "domain-not-allowed"])
async def test_a_fetch_that_cannot_be_used_says_why(http_server, path, policy, error):
    base, _ = http_server
    with pytest.raises(MediaError, match=error):
        await fetch(base + path, policy)


@pytest.mark.parametrize("url, error", [
    ("file:///etc/passwd", "scheme must be http, https or data"),
    ("ftp://example.com/a.png", "scheme must be http, https or data"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("data:image/png;base64,@@@", "base64 is not valid"),
    ("data:image/png", "must read data:"),
])
async def test_a_url_that_is_not_an_image_url_is_refused(url, error):
    with pytest.raises(MediaError, match=error):
        await fetch(url, LOCAL)


def test_bytes_that_are_not_an_accepted_image_are_refused():
    with pytest.raises(MediaError, match="not an image"):
        decode(b"hello, not an image")
    with pytest.raises(MediaError, match="format GIF is not accepted"):
        decode(image_bytes("GIF"))
    with pytest.raises(MediaError, match="cannot be decoded"):
        decode(image_bytes("PNG")[:200])  # cut short


@pytest.mark.parametrize("side", [9000, 20000])  # past our cap; past Pillow's own too
def test_a_decompression_bomb_is_refused_before_its_pixels_are_decoded(side):
    bomb = io.BytesIO()
    Image.new("1", (side, side)).save(bomb, format="PNG")  # a few kB of file, 81 or 400 million pixels
    assert len(bomb.getvalue()) < 100_000
    with pytest.raises(MediaError, match="more than the 67108864 pixels the gateway decodes"):
        decode(bomb.getvalue())


def test_pixels_are_resized_as_gemma3s_image_processor_resizes_them():
    processors = pytest.importorskip("transformers.models.gemma3.image_processing_pil_gemma3")
    data = image_bytes("PNG")
    expected = processors.Gemma3ImageProcessorPil(size={"height": 16, "width": 16})(
        images=Image.open(io.BytesIO(data)), return_tensors="np")["pixel_values"][0]
    raw = np.frombuffer(resized_pixels(decode(data), 16, 16), dtype=np.uint8).reshape(16, 16, 3)
    assert np.abs((raw.transpose(2, 0, 1) / 255 - 0.5) / 0.5 - expected).max() < 1e-6
