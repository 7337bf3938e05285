"""Stands in for vLLM's root `tests/conftest.py` when bench/vllm_tests.py runs vLLM's test files:
the markers vLLM registers, and its tokenizer loader mapped to the stack's own model."""

from __future__ import annotations

import functools
import os

import pytest

MARKERS = ("slow_test", "skip_global_cleanup", "core_model", "hybrid_model", "cpu_model", "cpu_test", "split",
           "distributed", "optional")


def pytest_configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    """Each case: whether it asked the stack anything (a server among its fixtures, or one it started),
    or is one of vLLM's unit tests of its own classes, which say nothing about Switchyard."""
    from tests.utils import STARTED, RemoteOpenAIServer

    before = STARTED[0]
    try:
        return (yield)
    finally:
        served = STARTED[0] > before or any(isinstance(v, RemoteOpenAIServer)
                                            for v in getattr(item, "funcargs", {}).values())
        item.user_properties.append(("served", served))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    from tests.utils import STARTED

    before = STARTED[0]
    try:
        return (yield)
    finally:
        if STARTED[0] > before:
            item.user_properties.append(("served", True))


def _recorded(send):
    """requests' Session.send, each request and its status recorded for the case that made it."""

    def send_and_record(self, request, **kwargs):
        from tests.utils import record_request

        response = send(self, request, **kwargs)
        body = request.body.encode() if isinstance(request.body, str) else request.body
        record_request(request.method, request.url, body, response.status_code)
        return response

    return send_and_record


import requests  # noqa: E402

requests.Session.send = _recorded(requests.Session.send)


@functools.cache
def _our_tokenizer(**kwargs):
    """The stack serves the default GGUF under each file's model name; its tokenizer answers for that name."""
    import transformers

    from shared.models.model_files import default_model_path

    folder, name = os.path.split(default_model_path())
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _get_tokenizer(tokenizer_name, *args, **kwargs):
    return _our_tokenizer()


import vllm.tokenizers  # noqa: E402  (vLLM's own sources, from its sdist)

vllm.tokenizers.get_tokenizer = _get_tokenizer


def _from_pretrained(original):
    """transformers' loader with a Hub id (not a folder here) mapped to the stack's model."""

    def load(name, *args, **kwargs):
        if isinstance(name, str) and not os.path.exists(name) and "gguf_file" not in kwargs:
            return _our_tokenizer()
        return original(name, *args, **kwargs)

    return load


import transformers  # noqa: E402

transformers.AutoTokenizer.from_pretrained = _from_pretrained(transformers.AutoTokenizer.from_pretrained)


class LocalAssetServer:
    """vLLM's server of test images and audio, for its multimodal cases: their images come from the
    internet and their model (SmolVLM, Idefics3) from the Hub, neither of which is here."""

    def __getattr__(self, name):
        raise RuntimeError("multimodal inputs: vLLM's test images and the file's image model come from the "
                           "internet and huggingface.co, which this machine cannot reach")


@pytest.fixture(scope="session")
def local_asset_server() -> LocalAssetServer:
    return LocalAssetServer()
