"""Stands in for vLLM's `tests/utils.py` when bench/vllm_tests.py runs vLLM's test files: its
`RemoteOpenAIServer` starts a Switchyard stack (`make run`'s launcher) instead of `vllm serve`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
import requests

VLLM_PATH = Path(__file__).parent.parent
ROCM_EXTRA_ARGS: list[str] = []
REPO = Path(os.environ.get("SY_REPO", Path.cwd()))
REPORT = os.environ.get("SY_VLLM_REPORT")  # JSON lines: what each server was asked for and what it got
REQUESTS = os.environ.get("SY_VLLM_REQUESTS")  # JSON lines: each HTTP request a case made, and its status
BODY_CHARS = 600  # of a request's body, in the record
STARTED = [0]  # stacks started so far (conftest.py tells a case that asked one from vLLM's unit tests)

# vLLM's flags for a GPU or its own engine, which a CPU stack has no use for, and flags turning on
# what a stack always serves (auto tool choice, /tokenizer_info, /sleep, chunked prefill)
IGNORED = {"--dtype", "--enforce-eager", "--gpu-memory-utilization", "--seed", "--trust-remote-code",
           "--max-cudagraph-capture-size", "--disable-log-stats", "--disable-log-requests", "--async-scheduling",
           "--enable-auto-tool-choice", "--enable-tokenizer-info-endpoint", "--enable-sleep-mode",
           "--enable-chunked-prefill"}
PASSED = {"--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--enable-prefix-caching",
          "--no-enable-prefix-caching", "--tool-call-parser", "--reasoning-parser", "--api-key", "--max-logprobs",
          "--enable-per-request-metrics"}


def record_request(method: str, url: str, body: bytes | None, status: int | None) -> None:
    """One request of the running case (PYTEST_CURRENT_TEST), for the runner's list of failures."""
    if not REQUESTS:
        return
    text = (body or b"").decode("utf-8", errors="replace")
    with open(REQUESTS, "a") as f:
        f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0], "method": method,
                            "url": url, "body": text[:BODY_CHARS] + ("..." if len(text) > BODY_CHARS else ""),
                            "status": status}) + "\n")


def _log_sync(response: httpx.Response) -> None:
    record_request(response.request.method, str(response.request.url), response.request.content, response.status_code)


async def _log_async(response: httpx.Response) -> None:
    _log_sync(response)


def split_flags(args: list[str]) -> list[list[str]]:
    """["--a", "1", "--b"] -> [["--a", "1"], ["--b"]]; "--a=1" stays one item."""
    groups: list[list[str]] = []
    for arg in map(str, args):
        if arg.startswith("--") or not groups:
            groups.append([arg])
        else:
            groups[-1].append(arg)
    return groups


def model_context() -> int:
    """The default model's context length: a file's --max-model-len for a longer model is cut to it."""
    from shared.models.model_files import default_model_path, inspect_artifact

    return inspect_artifact(default_model_path())[1]


def translate(model: str, args: list[str]) -> tuple[list[str], list[str], list[str]]:
    """vLLM's serve flags -> (the stack's flags, flags ignored as the GPU's or changed, flags we lack)."""
    ours, ignored, lacking = ["--model", model], [], []
    for group in split_flags(args):
        flag = group[0].split("=", 1)[0]
        if flag == "--served-model-name":
            ours[1] = group[1] if len(group) > 1 else group[0].split("=", 1)[1]
        elif flag == "--max-model-len" and len(group) == 2 and int(group[1]) > model_context():
            ours += [flag, str(model_context())]
            ignored.append(f"{' '.join(group)} (cut to the model's {model_context()})")
        elif flag in PASSED:
            ours += group
        elif flag in IGNORED:
            ignored.append(" ".join(group))
        else:
            lacking.append(" ".join(group))
    return ours, ignored, lacking


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteOpenAIServer:
    """A Switchyard stack serving the default model under the test's model name."""

    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict: dict[str, str] | None = None,
                 seed: int | None = 0, auto_port: bool = True, max_wait_seconds: float | None = None,
                 override_hf_configs: dict | None = None) -> None:
        STARTED[0] += 1
        flags, ignored, lacking = translate(model, list(vllm_serve_args))
        self.show_hidden_metrics = False  # the flag asking for them is one the stack lacks
        self.host, self.port = "127.0.0.1", free_port()
        self.workdir = tempfile.mkdtemp(prefix="sy-vllm-")
        env = {**os.environ, **(env_dict or {}), "SY_NATS_STORE_DIR": os.path.join(self.workdir, "nats")}
        env.pop("PYTHONPATH", None)  # vLLM's sources stay out of the stack
        self.log = open(os.path.join(self.workdir, "stack.log"), "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "switchyard.launcher", "--port", str(self.port), *flags],
                                     cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        if REPORT:
            with open(REPORT, "a") as f:
                f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "model": model, "flags": flags,
                                    "ignored": ignored, "lacking": lacking}) + "\n")
        try:
            self._wait_ready(max_wait_seconds or 300)
        except Exception:
            self._shutdown()
            raise

    def _wait_ready(self, timeout: float) -> None:
        """Ready once the launcher says so (its workers have loaded the model), as vLLM's /health."""
        log = Path(self.log.name)
        deadline = time.monotonic() + timeout
        while b"[launcher] ready" not in log.read_bytes():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the stack exited ({self.proc.returncode}): {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("the stack did not become ready in time")
            time.sleep(0.5)
        requests.get(self.url_for("health"), timeout=30).raise_for_status()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._shutdown()

    def _shutdown(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)  # a failed start's log is in the error it raised

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return f"{self.url_root}/" + "/".join(part.strip("/") for part in parts if part)

    def get_client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        kwargs.setdefault("http_client", openai.DefaultHttpxClient(event_hooks={"response": [_log_sync]}))
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        kwargs.setdefault("http_client", openai.DefaultAsyncHttpxClient(event_hooks={"response": [_log_async]}))
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)


def _needs_gpus(*_args, **_kwargs):
    return pytest.mark.skip(reason="needs GPUs (vLLM's own hardware marks)")


def multi_gpu_only(*, num_gpus: int = 2):
    return _needs_gpus()


def multi_gpu_test(*, num_gpus: int):
    return _needs_gpus()


def large_gpu_mark(min_gb: int):
    return _needs_gpus()


def large_gpu_test(*, min_gb: int):
    return _needs_gpus()


requires_fp8 = pytest.mark.skip(reason="needs an FP8 GPU (vLLM's own hardware mark)")


def __getattr__(name: str):
    raise AttributeError(f"vLLM's test helper {name!r} is not in Switchyard's stand-in for tests/utils.py")
