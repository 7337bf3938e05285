"""`python -m bench.vllm_tests`: vLLM's own OpenAI-server test files run against Switchyard stacks,
with pass/fail per file and the categories of what fails (docs/vllm_compat.md carries the table).

    python -m bench.vllm_tests                      # the default files, vLLM 0.33.0's sdist from PyPI
    python -m bench.vllm_tests --files serve/tokenize/test_tokenization.py --out bench/results/vllm.md

vLLM's sdist is fetched from PyPI (digest checked) into the cache; its `vllm/` sources and
`tests/` are used as they are, except `tests/utils.py` and `tests/conftest.py`, which
bench/vllm_shim/ replaces: `RemoteOpenAIServer` starts `make run`'s launcher serving the default
model under the file's model name, instead of `vllm serve`.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

from bench.vllm_verdicts import categorize, failure_lines
from shared.models.model_files import cache_root

REPO = Path(__file__).resolve().parent.parent
SHIM = Path(__file__).resolve().parent / "vllm_shim"
# the files the round-2 issue measured, plus the other server tests of vLLM's OpenAI surface
DEFAULT_FILES = (
    "serve/instrumentator/test_basic.py",
    "openai/completion/test_completion.py",
    "openai/chat_completion/test_chat.py",
    "serve/tokenize/test_tokenization.py",
    "openai/test_return_tokens_as_ids.py",
    "openai/completion/test_prompt_validation.py",
    "serve/instrumentator/test_metrics.py",
    "openai/chat_completion/test_chat_completion.py",
    "openai/chat_completion/test_chat_echo.py",
    "openai/chat_completion/test_completion_with_function_calling.py",
    "openai/chat_completion/test_include_reasoning.py",
    "openai/chat_completion/test_logprob_token_ids.py",
    "openai/test_return_token_ids.py",
    "openai/test_chunked_prompt.py",
    "openai/models/test_models.py",
    "openai/responses/test_basic.py",
    "openai/responses/test_stateful.py",
    "openai/responses/test_function_call.py",
    "serve/lora/test_lora_adapters.py",
    "rl/state_transitions/test_sleep.py",
)
# packages vLLM's sources import that a Switchyard venv lacks; installed beside them, not into the venv
EXTRA_PACKAGES = ("anthropic==2.14.0", "apache-tvm-ffi==0.1.15.post2", "blake3==1.0.11", "cachetools==8.0.2",
                  "cbor2==6.3.0", "cloudpickle==3.1.3", "compressed-tensors==0.20.0", "depyf==0.20.0",
                  "diskcache==5.6.3", "einops==0.8.2", "gguf==0.19.0", "lark==1.3.1", "llguidance==1.9.1",
                  "mistral-common==1.13.1", "openai-harmony==0.0.8", "partial-json-parser==0.2.1.1.post7",
                  "pillow==13.0.0", "prometheus-fastapi-instrumentator==8.1.0", "py-cpuinfo==9.0.0",
                  "pybase64==1.5.1", "pyzmq==27.3.0", "tblib==3.2.2", "watchfiles==1.3.0", "xgrammar==0.2.8")
def fetch_sdist(version: str, cache: Path) -> Path:
    """vLLM's source distribution from PyPI, its sha256 checked against the index's."""
    with urllib.request.urlopen("https://pypi.org/pypi/vllm/json", timeout=60) as resp:
        releases = json.load(resp)["releases"]
    (entry,) = [u for u in releases[version] if u["packagetype"] == "sdist"]
    path = cache / entry["filename"]
    if not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() != entry["digests"]["sha256"]:
        url = entry["url"] if entry["url"].startswith("http") else "https://pypi.org/" + entry["url"].lstrip("./")
        print(f"[vllm-tests] downloading {entry['filename']} ({entry['size'] >> 20} MiB)", flush=True)
        urllib.request.urlretrieve(url, path)
        if hashlib.sha256(path.read_bytes()).hexdigest() != entry["digests"]["sha256"]:
            sys.exit(f"[vllm-tests] {path}: sha256 differs from PyPI's")
    return path


def prepare(version: str) -> Path:
    """The workspace: vLLM's `vllm/` and `tests/` from the sdist, our shim in place of two files."""
    cache = cache_root() / "vllm-tests"
    cache.mkdir(parents=True, exist_ok=True)
    sdist = fetch_sdist(version, cache)
    root = cache / f"vllm-{version}"
    if not (root / "vllm").is_dir():
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.split("/")[1:2] in (["vllm"], ["tests"])]
            tar.extractall(cache, members=members, filter="data")
    for name in ("utils.py", "conftest.py"):
        shutil.copyfile(SHIM / name, root / "tests" / name)
    deps = cache / "deps"
    marker = deps / (".installed-" + hashlib.sha256(" ".join(EXTRA_PACKAGES).encode()).hexdigest()[:12])
    if not marker.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(deps),
                        *EXTRA_PACKAGES], check=True)
        marker.touch()
    return root


def run_file(root: Path, name: str, results: Path, timeout_s: float) -> dict:
    """One of vLLM's files under pytest, from a clean start (no earlier run's results, no process of
    an earlier file left); its cases' outcomes, what its servers were asked for, the requests made."""
    stem = name.replace("/", "__")
    junit, report, asked = (results / f"{stem}.{ext}" for ext in ("xml", "jsonl", "requests.jsonl"))
    for stale in (junit, report, asked):
        stale.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root.parent / "deps"), str(REPO)]),
           "SY_REPO": str(REPO), "SY_VLLM_REPORT": str(report), "SY_VLLM_REQUESTS": str(asked),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    cmd = [sys.executable, "-m", "pytest", f"tests/entrypoints/{name}", "-p", "no:cacheprovider", "-q", "-rN",
           f"--junitxml={junit}", "-o", "junit_family=xunit1", "-o", "asyncio_default_fixture_loop_scope=function",
           "--timeout", "600"]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        proc.wait(timeout=timeout_s)
        finished = True
    except subprocess.TimeoutExpired:
        finished = False
    left = kill_left(str(report), proc.pid)
    if finished and junit.exists():
        cases = read_junit(junit)
    else:
        cases = [{"name": name, "outcome": "error", "message": f"the file did not finish within {timeout_s:g}s",
                  "source": "", "errors": [], "served": True}]
    for case in cases:
        if case["outcome"] in ("failed", "error"):
            case["category"], case["subject"] = categorize(case["message"], case["source"], case["errors"])
    servers = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    made = [json.loads(line) for line in asked.read_text().splitlines()] if asked.exists() else []
    return {"file": name, "cases": cases, "servers": servers, "requests": made, "left_running": left}


def kill_left(marker: str, group: int) -> int:
    """Ends the file's pytest and every process it started (stacks start their own sessions: they are
    found by the report path in their environment); returns how many were still running."""
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
    left = 0
    needle = f"SY_VLLM_REPORT={marker}".encode()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes().split(b"\0"):
                os.kill(int(environ.parent.name), signal.SIGKILL)
                left += 1
        except (OSError, ValueError):
            continue
    return left


def read_junit(path: Path) -> list[dict]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message, source, errors = "passed", "", "", []
        served = any(p.get("name") == "served" and p.get("value") == "True" for p in case.iter("property"))
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                body = child.text or ""
                errors = [line[1:].strip() for line in body.splitlines() if line.startswith("E ")]
                source, message = body, child.get("message") or ""
        # a case that errored before its fixtures (a collection error) is counted as the stack's
        cases.append({"name": case.get("name"), "outcome": outcome, "message": message, "source": source,
                      "errors": errors, "served": served or not any(True for _ in case.iter("property"))})
    return cases


def table(runs: list[dict]) -> str:
    """Every case's outcome by file: those that asked a stack, and vLLM's unit tests of its own
    classes (no server) apart, failures of both by category."""
    lines = ["| vLLM test file | passed | failed | errors | skipped | own classes: passed / failed | "
             "what fails, by category |", "|---|---|---|---|---|---|---|"]
    totals = collections.Counter()
    for run in runs:
        # an error is the stack's too: a case whose setup failed before its server came up (a Hub download)
        served = [c for c in run["cases"] if c["served"] or c["outcome"] == "error"]
        units = [c for c in run["cases"] if c not in served]
        count = collections.Counter(c["outcome"] for c in served)
        count["unit_passed"] = sum(c["outcome"] == "passed" for c in units)
        count["unit_failed"] = sum(c["outcome"] == "failed" for c in units)
        totals.update(count)
        failing = collections.Counter(c["category"] for c in run["cases"] if c["outcome"] in ("failed", "error"))
        why = "; ".join(f"{n} {cat}" for cat, n in failing.most_common())
        lacking = sorted({flag for s in run["servers"] for flag in s["lacking"]})
        if lacking:
            why += ("; " if why else "") + "flags we lack: " + ", ".join(f"`{f}`" for f in lacking)
        if run.get("left_running"):
            why += ("; " if why else "") + f"{run['left_running']} processes left running (killed)"
        lines.append(f"| `{run['file']}` | {count['passed']} | {count['failed']} | {count['error']} | "
                     f"{count['skipped']} | {count['unit_passed']} / {count['unit_failed']} | {why} |")
    lines.append(f"| **all** | **{totals['passed']}** | **{totals['failed']}** | **{totals['error']}** | "
                 f"**{totals['skipped']}** | {totals['unit_passed']} / {totals['unit_failed']} | |")
    return "\n".join(lines)


def report(runs: list[dict]) -> str:
    failures = failure_lines(runs)
    return table(runs) + ("\n\nEach failure, its last request and the difference:\n\n" + "\n".join(failures)
                          if failures else "")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-version", default="0.33.0")
    p.add_argument("--files", nargs="*", default=list(DEFAULT_FILES), help="under vLLM's tests/entrypoints/")
    p.add_argument("--timeout-s", type=float, default=1800, help="per file")
    p.add_argument("--out", default=None, help="markdown path; the cases' outcomes go to a .json beside it")
    p.add_argument("--table-from", default=None, metavar="RUN.json", help="print the table of an earlier run")
    args = p.parse_args(argv)
    if args.table_from:
        print(report(json.loads(Path(args.table_from).read_text())))
        return
    root = prepare(args.vllm_version)
    results = root.parent / "results"
    results.mkdir(exist_ok=True)
    runs = []
    for name in args.files:
        print(f"[vllm-tests] {name}", flush=True)
        runs.append(run_file(root, name, results, args.timeout_s))
        count = collections.Counter(c["outcome"] for c in runs[-1]["cases"])
        print(f"[vllm-tests]   {dict(count)}", flush=True)
    header = (f"vLLM {args.vllm_version}'s test files against Switchyard ({platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores), {datetime.date.today()}")
    text = header + "\n\n" + report(runs)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
