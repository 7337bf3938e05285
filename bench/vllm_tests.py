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
import subprocess
import sys
import tarfile
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

from shared.model_files import cache_root

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
# (category, words in a failure's text), first match wins; "other" is what none names
CATEGORIES = (
    ("LoRA (issue 36)", ("lora",)),
    ("needs files from the Hugging Face Hub", ("huggingface", "hf_hub", "offline", "snapshot_download",
                                               "localentrynotfound", "couldn't connect to 'https://huggingface.co'")),
    ("needs the file's own model (answers of a larger or reasoning model)", ("assert '", 'assert "', "reasoning",
                                                                             "expected a tool call")),
    ("a field or route we refuse or lack", ("404", "400", "422", "not found", "unrecognized", "refused")),
    ("vLLM's internals or test helpers", ("vllm.", "is not in switchyard's stand-in", "importerror",
                                          "modulenotfounderror")),
)


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
    """One of vLLM's files under pytest; its cases' outcomes, and what its servers were asked for."""
    junit, report = results / (name.replace("/", "__") + ".xml"), results / (name.replace("/", "__") + ".jsonl")
    report.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root.parent / "deps"), str(REPO)]),
           "SY_REPO": str(REPO), "SY_VLLM_REPORT": str(report), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_TARGET_DEVICE": "cpu"}
    cmd = [sys.executable, "-m", "pytest", f"tests/entrypoints/{name}", "-p", "no:cacheprovider", "-q", "-rN",
           f"--junitxml={junit}", "-o", "junit_family=xunit1", "-o", "asyncio_default_fixture_loop_scope=function", "--timeout", "600"]
    try:
        subprocess.run(cmd, cwd=root, env=env, timeout=timeout_s, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pass
    cases = read_junit(junit) if junit.exists() else [{"name": name, "outcome": "error",
                                                       "text": "the file did not finish within the time limit"}]
    servers = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    return {"file": name, "cases": cases, "servers": servers}


def read_junit(path: Path) -> list[dict]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, text = "passed", ""
        served = any(p.get("name") == "served" and p.get("value") == "True" for p in case.iter("property"))
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                errors = [line[1:].strip() for line in (child.text or "").splitlines() if line.startswith("E ")]
                text = "\n".join([child.get("message") or "", *errors])  # the error, not the test's source
        # a case that errored before its fixtures (a collection error) is counted as the stack's
        cases.append({"name": case.get("name"), "outcome": outcome, "text": text,
                      "served": served or not any(True for _ in case.iter("property"))})
    return cases


def category(text: str) -> str:
    lowered = text.lower()
    for name, words in CATEGORIES:
        if any(w in lowered for w in words):
            return name
    return "other"


def table(runs: list[dict]) -> str:
    """Cases that asked a stack, by file; vLLM's unit tests of its own classes (no server) apart."""
    lines = ["| vLLM test file | passed | failed | errors | skipped | unit tests of vLLM's own classes | "
             "what fails, by category |", "|---|---|---|---|---|---|---|"]
    totals = collections.Counter()
    for run in runs:
        # an error is the stack's too: a case whose setup failed before its server came up (a Hub download)
        served = [c for c in run["cases"] if c["served"] or c["outcome"] == "error"]
        count = collections.Counter(c["outcome"] for c in served)
        count["unit"] = len(run["cases"]) - len(served)
        totals.update(count)
        failing = collections.Counter(category(c["text"]) for c in served if c["outcome"] in ("failed", "error"))
        why = "; ".join(f"{n} {cat}" for cat, n in failing.most_common())
        lacking = sorted({flag for s in run["servers"] for flag in s["lacking"]})
        if lacking:
            why += ("; " if why else "") + "flags we lack: " + ", ".join(f"`{f}`" for f in lacking)
        lines.append(f"| `{run['file']}` | {count['passed']} | {count['failed']} | {count['error']} | "
                     f"{count['skipped']} | {count['unit']} | {why} |")
    lines.append(f"| **all** | **{totals['passed']}** | **{totals['failed']}** | **{totals['error']}** | "
                 f"**{totals['skipped']}** | {totals['unit']} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-version", default="0.33.0")
    p.add_argument("--files", nargs="*", default=list(DEFAULT_FILES), help="under vLLM's tests/entrypoints/")
    p.add_argument("--timeout-s", type=float, default=1800, help="per file")
    p.add_argument("--out", default=None, help="markdown path; the cases' outcomes go to a .json beside it")
    p.add_argument("--table-from", default=None, metavar="RUN.json", help="print the table of an earlier run")
    args = p.parse_args(argv)
    if args.table_from:
        print(table(json.loads(Path(args.table_from).read_text())))
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
    text = header + "\n\n" + table(runs)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
