"""A GGUF's SentencePiece vocabulary (Llama 2's, Phi-3's, Gemma's `llama` tokenizer model) against
transformers' own GGUF tokenizer on the same file: the same ids for text with leading and repeated
spaces, newlines, digits, accents and emoji (byte fallback), and the same text back.

The vocabulary is made here (no SentencePiece model ships with the suite): a BPE learned on the
test's sentences, laid out as llama.cpp writes SentencePiece files (<unk>, <s>, </s>, the 256 byte
tokens, then the pieces best first, scored by their rank, and for Gemma runs of spaces spelled as
spaces).
"""

from __future__ import annotations

import os

import pytest

from shared.models.tokenizer import load_tokenizer
from tests import gguf_writer

transformers = pytest.importorskip("transformers")
CORPUS = ["The capital of France is Paris.", "Numbers like 12345 and 2026 appear often.",
          "def main():\n    return 42\n", "Spaces  between   words, and tabs\tor newlines\n\n."] * 20
TEXTS = ["Hello world", "  two leading spaces", "The capital of France is Paris.\nNext line",
         "ünïcödé ✓ 😀 and 12345", "def f(x):\n    return x  # spaced", "a\n\n\nb"]
NORMAL, UNK_TYPE, CONTROL, BYTE = 1, 2, 3, 6  # llama.cpp's token types


def _pieces() -> list[str]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    vocab = tok.get_vocab()
    return sorted(vocab, key=vocab.get)


def spm_vocab(arch: str, pieces: list[str]) -> dict:
    """The vocabulary's fields as llama.cpp writes a SentencePiece model (Gemma: no space prefix)."""
    gemma = arch.startswith("gemma")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        [p.replace("\u2581", " ") if gemma and set(p) == {"\u2581"} and len(p) > 1 else p for p in pieces]
    return dict(tokens=tokens, types=[UNK_TYPE, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces),
                scores=[0.0] * 259 + [-float(i) for i in range(len(pieces))], space_prefix=not gemma)


def add_vocab(w, vocab: dict) -> None:
    w.add_tokenizer_model("llama")
    w.add_token_list(vocab["tokens"])
    w.add_token_scores(vocab["scores"])
    w.add_token_types(vocab["types"])
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(vocab["space_prefix"])


def _write(path: str, arch: str, pieces: list[str]) -> None:
    import gguf

    w = gguf.GGUFWriter(path, arch)
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 256), (w.add_embedding_length, 64),
                       (w.add_head_count, 4)):
        add(value)
    add_vocab(w, spm_vocab(arch, pieces))
    gguf_writer.finish(w)


@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma3"])
def test_a_sentencepiece_gguf_tokenizes_as_transformers_does(tmp_path, arch):
    path = str(tmp_path / f"{arch}.gguf")
    _write(path, arch, _pieces())
    ours = load_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False), (arch, text)
        assert ours.decode(ids) == theirs.decode(ids), (arch, text)
    assert ours.encode("Hi")[0] == 1  # <s>, as the file's add_bos_token says
    emoji = ours.encode("😀", add_special_tokens=False)
    assert b"".join(ours.token_bytes(i) for i in emoji).strip() == "😀".encode()  # four byte tokens


def test_byte_pieces_that_are_not_utf8_do_not_break_incremental_detokenization(tmp_path):
    """A random model emits byte tokens that are no UTF-8 (the tokenizers stream then refuses its
    own changed prefix): the detokenizer goes on by offsets, and the text after them is whole."""
    from shared.models.detokenizer import IncrementalDetokenizer

    path = str(tmp_path / "phi3.gguf")
    _write(path, "phi3", _pieces())
    tok = load_tokenizer(path)
    ids = [301, 114, 261, 74, 147, 74, 389, 51, 319, 412, 131, 275]  # a sequence the stream refuses (found by search)
    detok = IncrementalDetokenizer(tok.tokenizer, [])
    text = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert detok.stream is None  # it fell back
    assert text.endswith(tok.decode(ids[-6:-1]).lstrip()[-20:] + tok.decode(ids[-1:]))
    later = IncrementalDetokenizer(tok.tokenizer, [])
    assert later.push(tok.encode("Paris is the capital.", add_special_tokens=False)) + later.flush() == \
        "Paris is the capital."

@pytest.mark.stack
def test_a_phi3_gguf_with_its_sentencepiece_vocabulary_serves_through_the_stack(tmp_path_factory):
    """A random Phi-3-mini-shaped GGUF (window shrunk to 24) with a SentencePiece vocabulary, served
    by `make run`'s services on their defaults: the prompt tokenized as transformers does, and a
    greedy completion past the window equal to transformers' generate."""
    import openai

    from tests.conftest import _start_stack
    from tests.model_helpers import transformers_greedy
    from tests.test_model_families import PHI3

    vocab = spm_vocab("phi3", _pieces())
    config = transformers.Phi3Config(**dict(PHI3, vocab_size=len(vocab["tokens"]), intermediate_size=512,
                                            num_hidden_layers=2, initializer_range=0.08, sliding_window=24))
    theirs = transformers.Phi3ForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("phi3-gguf")
    w = gguf_writer.phi3(theirs, str(folder / "phi3.gguf"))
    add_vocab(w, vocab)
    gguf_writer.finish(w)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file="phi3.gguf")
    stack = _start_stack(tmp_path_factory, "phi3-gguf", 1, ["--model-path", str(folder / "phi3.gguf"),
                                                            "--model", "phi3", "--no-deterministic"])
    try:
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)
        prompt = "The capital of France is Paris. Numbers like 12345 appear"
        got = client.completions.create(model="phi3", prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        ids = hf_tok.encode(prompt)
        assert got.usage.prompt_tokens == len(ids) and len(ids) + 24 > 24  # decode steps past the window
        assert got.choices[0].token_ids == transformers_greedy(theirs, ids, 24)
    finally:
        stack.stop()
