"""The model's text -> OpenAI tool calls, incrementally, so a stream can send each call as it completes.

- hermes (SmolLM2, Qwen, Hermes): calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks; text outside them is content. A tail that could begin a block is held back.
- json (Llama 3.x): the whole answer is a call object or a list of them; decided when the answer ends.
- mistral: content, then `[TOOL_CALLS]` and a JSON list of calls (or, from Mistral's v11
  tokenizers, `[TOOL_CALLS]name[ARGS]{...}` per call); decided when the answer ends.
- auto (the default): the chat template's own call syntax picks one of these (`resolve`).
Text that looks like a call but is not one (bad JSON, no name) stays content, as the model wrote it.
"""

from __future__ import annotations

import json
import uuid

from services.api.openai.tools.choice import MISTRAL_CALLS, TOOL_CALL_CLOSE, TOOL_CALL_OPEN


def tool_call(name: str, arguments) -> dict:
    """OpenAI's shape; arguments as JSON text."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def _as_call(value) -> dict | None:
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return tool_call(value["name"], value.get("arguments", value.get("parameters", {})))
    return None


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesParser:
    def __init__(self, accepts=lambda call: True):
        self.accepts = accepts  # a call it returns False for stays text
        self.buffer = ""
        self.in_call = False
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """-> (content that is certainly not part of a call, calls completed by this text)."""
        self.buffer += text
        content, calls = [], []
        while True:
            if not self.in_call:
                start = self.buffer.find(TOOL_CALL_OPEN)
                if start < 0:
                    keep = _held_back(self.buffer, TOOL_CALL_OPEN)
                    self._add_content(content, self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                self._add_content(content, self.buffer[:start])
                self.buffer, self.in_call = self.buffer[start + len(TOOL_CALL_OPEN) :], True
            else:
                end = self.buffer.find(TOOL_CALL_CLOSE)
                if end < 0:
                    break
                body, self.buffer, self.in_call = self.buffer[:end], self.buffer[end + len(TOOL_CALL_CLOSE) :], False
                call = self._parse(body)
                if call is None:
                    content.append(TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE)
                else:
                    calls.append(call)
        return "".join(content), calls

    def _add_content(self, content: list[str], text: str) -> None:
        if text.strip() or not self.num_calls:  # the blank lines between calls are not content
            content.append(text)

    def finish(self) -> tuple[str, list[dict]]:
        """The end of the answer: a block left open is content (the answer was cut short)."""
        rest = (TOOL_CALL_OPEN if self.in_call else "") + self.buffer
        self.buffer, self.in_call = "", False
        return ("" if self.num_calls and not rest.strip() else rest), []

    def _parse(self, body: str) -> dict | None:
        try:
            call = _as_call(json.loads(body))
        except json.JSONDecodeError:
            return None
        if call is None or not self.accepts(call):
            return None
        self.num_calls += 1
        return call


class JsonParser:
    def __init__(self, accepts=lambda call: True):
        self.accepts = accepts
        self.text = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.text.append(text)
        return "", []

    def finish(self) -> tuple[str, list[dict]]:
        text = "".join(self.text)
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        calls = [_as_call(v) for v in (value if isinstance(value, list) else [value])]
        if calls and all(c is not None and self.accepts(c) for c in calls):
            return "", calls
        return text, []


class MistralParser:
    def __init__(self, accepts=lambda call: True):
        self.accepts = accepts
        self.buffer = ""
        self.in_calls = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        if self.in_calls:
            return "", []
        start = self.buffer.find(MISTRAL_CALLS)
        if start >= 0:
            content, self.buffer, self.in_calls = self.buffer[:start], self.buffer[start:], True
            return content, []
        keep = _held_back(self.buffer, MISTRAL_CALLS)
        content, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        return content, []

    def finish(self) -> tuple[str, list[dict]]:
        text, self.buffer = self.buffer, ""
        if not self.in_calls:
            return text, []
        calls = self._calls(text)
        if calls and all(c is not None and self.accepts(c) for c in calls):
            return "", calls
        return text, []

    @staticmethod
    def _calls(text: str) -> list[dict | None]:
        parts = [p for p in text.split(MISTRAL_CALLS) if p.strip()]
        if len(parts) == 1 and parts[0].lstrip().startswith(("[", "{")):
            try:
                value = json.loads(parts[0])
            except json.JSONDecodeError:
                return []
            return [_as_call(v) for v in (value if isinstance(value, list) else [value])]
        calls = []
        for part in parts:  # v11: name[ARGS]{arguments}
            name, sep, arguments = part.partition("[ARGS]")
            try:
                calls.append(tool_call(name.strip(), json.loads(arguments)) if sep and name.strip() else None)
            except json.JSONDecodeError:
                calls.append(None)
        return calls



def resolve(name: str, chat_template: str | None) -> str:
    """--tool-call-parser auto: the format the model's chat template writes calls in (a template
    without tools gets the Hermes one, tools/prompt.py)."""
    if name != "auto":
        return name
    template = chat_template or ""
    if MISTRAL_CALLS in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:  # Llama 3.x: a JSON object is the call
        return "json"
    return "hermes"


def parser_for(name: str, accepts=lambda call: True) -> HermesParser | JsonParser | MistralParser:
    return {"hermes": HermesParser, "json": JsonParser, "mistral": MistralParser}[name](accepts)
