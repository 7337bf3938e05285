"""What a failing vLLM test case says about Switchyard: its category, read from what failed (the
exception's type, or the subject of the failing assertion), and the request it made before it."""

from __future__ import annotations

import re

MODEL = "needs the file's own model (its answers)"
HUB = "needs files from the Hugging Face Hub"
REFUSED = "a field or route we refuse or lack"
METRIC = "a metric family or count of vLLM's"
VALUE = "a field's value differs"
INTERNALS = "vLLM's internals or test helpers"
UNFINISHED = "did not finish in time"
OTHER = "other"

# exception types (the last dotted name) -> category
_EXCEPTIONS = {
    "BadRequestError": REFUSED, "NotFoundError": REFUSED, "UnprocessableEntityError": REFUSED,
    "HTTPError": REFUSED, "LocalEntryNotFoundError": HUB, "RepositoryNotFoundError": HUB, "GatedRepoError": HUB,
    "HFValidationError": HUB, "OfflineModeIsEnabled": HUB, "ImportError": INTERNALS, "ModuleNotFoundError": INTERNALS,
    "AttributeError": INTERNALS, "Timeout": UNFINISHED, "TimeoutError": UNFINISHED, "APITimeoutError": UNFINISHED,
}
# an assertion's subject (the asserted expression) -> category, first match wins
_SUBJECTS = (
    (re.compile(r"vllm:|metric|prometheus|/metrics"), METRIC),
    (re.compile(r"status_code|\.status\b"), REFUSED),
    (re.compile(r"content|\.text\b|message|tool_calls|finish_reason|reasoning|output_text|\.output\b|arguments"),
     MODEL),
    (re.compile(r"usage|token|logprob|\.id\b|\.model\b|choices|len\("), VALUE),
)


def exception_type(message: str) -> str:
    """'openai.BadRequestError: Error code: 400 ...' -> 'BadRequestError'."""
    head = message.split(":", 1)[0].strip()
    return head.rsplit(".", 1)[-1] if re.fullmatch(r"[\w.]+", head) else ""


def assertion_subject(source: str, errors: list[str]) -> str:
    """The asserted expression: the failing source line of the traceback ('>   assert x == y'), else
    pytest's rewritten 'assert ...' line."""
    for line in source.splitlines():
        if line.startswith(">") and "assert" in line:
            return line[1:].strip()
    return next((e for e in errors if e.startswith("assert")), "")


def categorize(message: str, source: str, errors: list[str]) -> tuple[str, str]:
    """(category, subject) of one failed or errored case."""
    if "did not finish within" in message:
        return UNFINISHED, ""
    if "Batch process exited early" in message:  # vLLM's own run_batch CLI: vLLM's engine, not a server's
        return INTERNALS, "vllm.entrypoints.openai.run_batch"
    lowered = (message + "\n" + "\n".join(errors)).lower()
    if "huggingface.co" in lowered or "hf_hub" in lowered:
        return HUB, exception_type(message)
    kind = exception_type(message)
    if kind == "AssertionError" or (not kind and "assert" in message):
        subject = assertion_subject(source, errors)
        for pattern, name in _SUBJECTS:
            if pattern.search(subject):
                return name, subject
        if "vllm:" in message:  # a helper's assertion (`sample.value == expected_value`) naming the metric
            return METRIC, subject
        return OTHER, subject
    if kind in _EXCEPTIONS:
        return _EXCEPTIONS[kind], kind
    if "vllm." in lowered or "stand-in for tests/utils.py" in lowered:
        return INTERNALS, kind
    return OTHER, kind


def last_request(requests: list[dict], case: str) -> dict | None:
    """The last HTTP request the case made through its server's clients (bench/vllm_shim records them)."""
    mine = [r for r in requests if r["test"].endswith("::" + case) or r["test"].endswith(case)]
    return mine[-1] if mine else None


def failure_lines(runs: list[dict]) -> list[str]:
    """Markdown: each failed or errored case, its category and subject, its last request, the difference."""
    lines = []
    for run in runs:
        for case in run["cases"]:
            if case["outcome"] not in ("failed", "error"):
                continue
            where = "" if case["served"] else " (vLLM's own classes)"
            lines.append(f"- `{run['file']}::{case['name']}`{where}: **{case['category']}**"
                         + (f" — `{case['subject'][:160]}`" if case.get("subject") else ""))
            request = last_request(run.get("requests", []), case["name"])
            if request:
                path = re.sub(r"^https?://[^/]+", "", request["url"])
                lines.append(f"  - request: `{request['method']} {path}` -> {request['status']}"
                             + (f" `{request['body'][:300]}`" if request["body"] else ""))
            for error in case["errors"][:4]:
                lines.append(f"  - `{error[:240]}`")
    return lines
