"""Reasoning parsers (`--reasoning-parser deepseek_r1 | qwen3`): a chat answer's thinking, between
`<think>` and `</think>`, becomes `reasoning` (and `reasoning_content`); the rest is the content, and its tool calls."""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def _overlap(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Splits one choice's text, delta by delta, into (reasoning, content), holding back what could
    still be a marker. Where the answer starts:
    - the prompt left a `<think>` open (the template opened it, as Qwen3's and R1's do): thinking;
    - deepseek_r1: thinking unless the prompt closed a think block (R1 may not write the opening tag);
    - qwen3: content, unless the answer itself opens with `<think>`."""

    def __init__(self, parser: str, prompt_text: str):
        opened, closed = prompt_text.rfind(START), prompt_text.rfind(END)
        self.in_reasoning = opened > closed or (parser == "deepseek_r1" and closed == -1)
        self.may_open = not self.in_reasoning  # a `<think>` at the very start of the answer opens it
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        reasoning, content = [], []
        while self.pending:
            if self.in_reasoning:
                at = self.pending.find(END)
                if at == -1:
                    keep = _overlap(self.pending, END)
                    reasoning.append(self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                reasoning.append(self.pending[:at])
                self.pending, self.in_reasoning, self.may_open = self.pending[at + len(END):], False, False
            elif self.may_open:
                head = self.pending.lstrip()
                if head.startswith(START):
                    self.pending, self.in_reasoning, self.may_open = head[len(START):], True, False
                elif START.startswith(head):
                    break  # could still be the opening tag
                else:
                    self.may_open = False
            else:
                content.append(self.pending)
                self.pending = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The answer ended: what was held back is final (an unclosed think is all reasoning)."""
        rest, self.pending, self.may_open = self.pending, "", False
        return (rest, "") if self.in_reasoning else ("", rest)
