"""bench/vllm_tests.py's own logic, without vLLM's files: how vLLM's serve flags map to the stack's,
and how the table counts cases (those that asked a stack apart from vLLM's unit tests)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from bench.vllm_tests import category, table


def _shim():
    path = Path(__file__).resolve().parent.parent / "bench" / "vllm_shim" / "utils.py"
    spec = importlib.util.spec_from_file_location("vllm_shim_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vllm_serve_flags_map_to_the_stacks_or_are_listed():
    flags, ignored, lacking = _shim().translate("Qwen/Qwen3-0.6B", [
        "--dtype", "bfloat16", "--max-model-len", "40960", "--enforce-eager", "--max-num-seqs", "128",
        "--reasoning-parser", "qwen3", "--enable-lora", "--lora-modules", "a=/x", "b=/y", "--served-model-name", "m"])
    assert flags == ["--model", "m", "--max-model-len", "8192", "--max-num-seqs", "128", "--reasoning-parser", "qwen3"]
    assert ignored == ["--dtype bfloat16", "--max-model-len 40960 (cut to the model's 8192)", "--enforce-eager"]
    assert lacking == ["--enable-lora", "--lora-modules a=/x b=/y"]


def test_the_table_counts_what_asked_a_stack_and_sorts_failures_by_category():
    cases = [
        {"name": "a", "outcome": "passed", "text": "", "served": True},
        {"name": "b", "outcome": "failed", "text": "Unrecognized request argument supplied: x (400)", "served": True},
        {"name": "c", "outcome": "error", "text": "LocalEntryNotFoundError: zephyr-7b-beta-lora", "served": False},
        {"name": "d", "outcome": "passed", "text": "", "served": False},  # vLLM's own classes over mocks
    ]
    text = table([{"file": "openai/test_x.py", "cases": cases,
                   "servers": [{"lacking": ["--enable-lora"], "ignored": [], "flags": []}]}])
    row = text.splitlines()[2]
    assert row.startswith("| `openai/test_x.py` | 1 | 1 | 1 | 0 | 1 |")
    assert "LoRA" in row and "a field or route" in row and "`--enable-lora`" in row
    assert category("assert 'Paris' in 'Lyon'") == "needs the file's own model (answers of a larger or reasoning model)"
