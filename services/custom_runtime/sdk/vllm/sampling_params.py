"""vLLM's SamplingParams, the fields Switchyard's engine carries out; any other is refused by name."""

from __future__ import annotations

SUPPORTED = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "seed": None, "stop": None,
             "stop_token_ids": None, "max_tokens": 16, "min_tokens": 0, "presence_penalty": 0.0,
             "frequency_penalty": 0.0, "repetition_penalty": 1.0, "ignore_eos": False, "skip_special_tokens": True}


class SamplingParams:
    def __init__(self, **fields):
        unknown = sorted(set(fields) - set(SUPPORTED))
        if unknown:
            raise TypeError(f"SamplingParams: {', '.join(unknown)} not supported by Switchyard's vLLM engine API "
                            f"(supported: {', '.join(SUPPORTED)})")
        for name, default in SUPPORTED.items():
            setattr(self, name, fields.get(name, default))
        if self.n != 1:
            raise ValueError(f"SamplingParams: n = {self.n} is not supported here: generate once per choice")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    def __repr__(self) -> str:
        return "SamplingParams(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in SUPPORTED) + ")"
