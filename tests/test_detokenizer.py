"""Incremental detokenization: multi-byte characters and stop strings held back correctly."""

from __future__ import annotations

import pytest

from shared.models.detokenizer import IncrementalDetokenizer
from shared.models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(default_model_path):
    return load_tokenizer(default_model_path)


def stream(tok, text: str, stop: list[str]) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok.tokenizer, stop)
    pieces = [d.push([t]) for t in tok.encode(text)]
    pieces.append(d.flush())
    return pieces, d


def test_multibyte_characters_never_split(tok):
    text = "Grüße aus Köln: 日本語 🚀 ok"
    pieces, _ = stream(tok, text, [])
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_and_is_not_returned(tok):
    pieces, d = stream(tok, "Paris is nice. Lyon too.", ["."])
    assert "".join(pieces) == "Paris is nice" and d.is_stopped


def test_possible_stop_prefix_is_held_back_then_released(tok):
    d = IncrementalDetokenizer(tok.tokenizer, ["END!"])
    out = "".join(d.push([t]) for t in tok.encode("the END is near"))
    assert not d.is_stopped
    assert out + d.flush() == "the END is near"


def test_chat_template_renders_smollm_format(tok):
    from services.api.openai.chat_template import render_chat

    text = render_chat(tok.chat_template, [{"role": "user", "content": "Hi"}], bos_token=tok.bos_token,
                       eos_token=tok.eos_token)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_matches_transformers(tok, hf_tokenizer):
    for s in ["Hello world 12345 café", "<|im_start|>user\nhi<|im_end|>\n", "日本語 🚀\n\n\tx=0.5"]:
        assert tok.encode(s) == hf_tokenizer.encode(s, add_special_tokens=False)
