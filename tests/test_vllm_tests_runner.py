"""bench/vllm_tests.py's own logic, without vLLM's files: how vLLM's serve flags map to the stack's,
how a failure is sorted, how the table counts cases, and that each file starts clean."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from bench.vllm_tests import kill_left, report
from bench.vllm_verdicts import HUB, INTERNALS, METRIC, MODEL, REFUSED, categorize


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


def _failed(name: str, message: str, source: str = "", served: bool = True, outcome: str = "failed") -> dict:
    errors = [line[1:].strip() for line in source.splitlines() if line.startswith("E ")]
    category, subject = categorize(message, source, errors)
    return {"name": name, "outcome": outcome, "message": message, "source": source, "errors": errors,
            "served": served, "category": category, "subject": subject}


def test_a_failure_is_sorted_by_what_failed_not_by_words_in_it():
    missing_metric = _failed("test_metrics_exist", "AssertionError: assert 'vllm:admission_rejections_total' in '# "
                             "HELP ... answer'", ">       assert metric in response.text\nE       AssertionError")
    answer = _failed("test_x", "AssertionError: assert 'Paris' in 'Lyon'",
                     '>       assert "Paris" in chat.choices[0].message.content\nE       assert \'Paris\' in \'Lyon\'')
    refused = _failed("test_y", "openai.BadRequestError: Error code: 400 - {'error': 'reasoning'}")
    hub = _failed("test_z", "OSError: We couldn't connect to 'https://huggingface.co' to load the files",
                  outcome="error")
    counted = _failed("test_w", "AssertionError: assert 180 == 190",
                      ">       assert sum == expected  # vllm:iteration_tokens_total\nE       assert 180 == 190")
    images = _failed("test_v", "RuntimeError: multimodal inputs: vLLM's test images and the file's image model "
                               "come from the internet and huggingface.co, which this machine cannot reach")
    batch = _failed("test_metrics_exist_run_batch", "Failed: Batch process exited early with returncode=1")
    assert [c["category"] for c in (missing_metric, answer, refused, hub, counted, images, batch)] == [
        METRIC, MODEL, REFUSED, HUB, METRIC, HUB, INTERNALS]
    assert answer["subject"] == 'assert "Paris" in chat.choices[0].message.content'


def test_the_table_shows_every_outcome_and_each_failure_with_its_request():
    cases = [
        {"name": "a", "outcome": "passed", "served": True},
        _failed("b", "openai.BadRequestError: Error code: 400 - unrecognized x"),
        _failed("c", "LocalEntryNotFoundError: zephyr-7b-beta-lora", served=False, outcome="error"),
        {"name": "d", "outcome": "passed", "served": False},  # vLLM's own classes over mocks
        _failed("e", "AssertionError: assert 1 == 0", ">       assert proc.returncode == 0", served=False),
    ]
    requests = [{"test": "tests/entrypoints/openai/test_x.py::b", "method": "POST",
                 "url": "http://127.0.0.1:1234/v1/completions", "body": '{"x": 1}', "status": 400}]
    text = report([{"file": "openai/test_x.py", "cases": cases, "requests": requests, "left_running": 2,
                    "servers": [{"lacking": ["--enable-lora"], "ignored": [], "flags": []}]}])
    row = text.splitlines()[2]
    assert row.startswith("| `openai/test_x.py` | 1 | 1 | 1 | 0 | 1 / 1 |")  # the failing unit case is shown
    assert REFUSED in row and HUB in row and "`--enable-lora`" in row and "2 processes left running" in row
    assert '- `openai/test_x.py::b`: **a field or route we refuse or lack**' in text
    assert '  - request: `POST /v1/completions` -> 400 `{"x": 1}`' in text
    assert "`openai/test_x.py::e` (vLLM's own classes)" in text


def test_processes_a_file_left_running_are_found_and_killed(tmp_path):
    marker = str(tmp_path / "report.jsonl")
    env = {**os.environ, "SY_VLLM_REPORT": marker}
    # as a stack is started; its first line says its exec is done and its environment readable in /proc
    # (Popen returns at exec's close-on-exec, before the kernel has set the new environment's bounds)
    stray = subprocess.Popen([sys.executable, "-c", "print('up', flush=True); import time; time.sleep(300)"],
                             env=env, start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert stray.stdout.readline() == b"up\n"
        assert kill_left(marker, group=stray.pid + 10**6) == 1  # its pytest's group already gone
        assert stray.wait(timeout=10) == -signal.SIGKILL
    finally:
        stray.kill()
        stray.stdout.close()


def test_the_shim_records_each_request_of_a_case(tmp_path, monkeypatch):
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("SY_VLLM_REQUESTS", str(log))
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/entrypoints/x.py::test_a (call)")
    _shim().record_request("POST", "http://h/v1/chat/completions", b'{"model": "m"}', 200)
    (line,) = log.read_text().splitlines()
    assert json.loads(line) == {"test": "tests/entrypoints/x.py::test_a", "method": "POST",
                                "url": "http://h/v1/chat/completions", "body": '{"model": "m"}', "status": 200}
