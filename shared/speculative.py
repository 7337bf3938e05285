"""--speculative-config: vLLM's JSON keys, typed and checked once; which methods run here."""

from __future__ import annotations

import msgspec

from shared.checks import ConfigError, json_object, struct_of

METHODS = ("ngram", "draft_model", "eagle3", "suffix")
# vLLM's other methods: known by name, refused with a message rather than an unknown-key error
METHODS_NOT_BUILT = ("eagle", "medusa", "mlp_speculator", "mtp")
SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
               "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
NGRAM_MODEL = "[ngram]"  # vLLM's older spelling of the n-gram method, as the "model"
MAX_SPECULATIVE_TOKENS = 16
# rows in a step above which no row speculates, where the config names no disable_by_batch_size: the
# crossover measured on the CPU worker (docs/speculative_decoding.md, docs/benchmarks.md)
DEFAULT_DISABLE_BY_BATCH_SIZE = 16
# the draft_model method's: its drafts cost a draft forward per position for every row, so it stops
# paying far sooner (SmolLM2 float32 with its Q4_1 GGUF drafting: 1.19x at c=2, 0.79x at c=4)
DRAFT_MODEL_DISABLE_BY_BATCH_SIZE = 2
# the suffix method's: its drafts run longer and are kept less often per position than n-gram's
# (SmolLM2, 8 drafts, forced on: output tok/s 1.02x at c=4, 0.92x at 16, 0.85x at 64)
SUFFIX_DISABLE_BY_BATCH_SIZE = 8


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What vLLM's SpeculativeConfig takes for the methods built here, with its defaults."""

    method: str | None = None
    model: str | None = None  # draft_model: the draft's checkpoint (a path or Hub id); "[ngram]": n-gram
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None  # n-gram: the shortest suffix matched (vLLM: 5 when neither is set)
    prompt_lookup_max: int | None = None  # n-gram: the longest
    disable_by_batch_size: int | None = None  # a step of more rows than this speculates for none
    # suffix decoding's (services/worker/suffix.py), vLLM's defaults: the trees' depth (the longest
    # match plus its drafts), the finished requests whose outputs are kept, the drafts per matched
    # token, and the least estimated probability a draft may have
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    @property
    def max_batch(self) -> int:
        """The most rows a step may have and still speculate."""
        if self.disable_by_batch_size is not None:
            return self.disable_by_batch_size
        return {"draft_model": DRAFT_MODEL_DISABLE_BY_BATCH_SIZE, "suffix": SUFFIX_DISABLE_BY_BATCH_SIZE}.get(
            self.method, DEFAULT_DISABLE_BY_BATCH_SIZE)

    def validate(self) -> SpeculativeConfig:
        """Settles vLLM's defaults (n-gram sizes) and refuses what cannot run, naming the key."""
        method = self.method or _infer_method(self.model)
        if method is None:
            raise ConfigError("speculative_config: name a method (\"method\": \"ngram\", or \"model\": a draft model)")
        if method in METHODS_NOT_BUILT:
            raise ConfigError(f"speculative_config: method {method!r} is not built here yet; this engine "
                              f"speculates with {' and '.join(METHODS)}")
        if method not in METHODS:
            raise ConfigError(f"speculative_config: unknown method {method!r}; allowed: {', '.join(METHODS)}")
        if method == "ngram" and self.model not in (None, NGRAM_MODEL):
            raise ConfigError("speculative_config: \"model\" names a draft model, and the n-gram method takes none")
        if method == "draft_model" and self.model in (None, NGRAM_MODEL):
            raise ConfigError("speculative_config: the draft_model method needs \"model\": the draft's checkpoint, "
                              "a smaller model of the same vocabulary")
        if method == "eagle3" and self.model in (None, NGRAM_MODEL):
            raise ConfigError("speculative_config: the eagle3 method needs \"model\": the EAGLE-3 head's checkpoint "
                              "(a speculators folder), trained for this model")
        if method == "suffix":
            return self._suffix()
        self._check_suffix_keys_unset(method)
        self._check_common()
        if method in ("draft_model", "eagle3"):
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ConfigError(f"speculative_config: prompt_lookup_min/max are the n-gram method's; "
                                  f"the {method} method drafts with its model")
            return msgspec.structs.replace(self, method=method)
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5  # vLLM's
        low, high = low or high, high or low
        if low < 1 or high < low:
            raise ConfigError(f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max "
                              f"(got {low} and {high})")
        return msgspec.structs.replace(self, method=method, model=None, prompt_lookup_min=low,
                                       prompt_lookup_max=high)

    def _suffix(self) -> SpeculativeConfig:
        """vLLM's suffix decoding: no model, no n-gram sizes; num_speculative_tokens defaults to the
        trees' depth (capped here at MAX_SPECULATIVE_TOKENS, the most lookahead a row is given)."""
        if self.model is not None or self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ConfigError("speculative_config: the suffix method drafts from its suffix trees: it takes no "
                              "\"model\" and no prompt_lookup_min/max")
        checks = [(self.suffix_decoding_max_tree_depth >= 2, "suffix_decoding_max_tree_depth must be 2 or more"),
                  (self.suffix_decoding_max_cached_requests >= 0, "suffix_decoding_max_cached_requests must be >= 0"),
                  (self.suffix_decoding_max_spec_factor > 0, "suffix_decoding_max_spec_factor must be > 0"),
                  (0 <= self.suffix_decoding_min_token_prob <= 1, "suffix_decoding_min_token_prob must be in [0, 1]")]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"speculative_config: {message}")
        k = self.num_speculative_tokens
        config = msgspec.structs.replace(self, method="suffix", num_speculative_tokens=k if k is not None else
                                         min(self.suffix_decoding_max_tree_depth, MAX_SPECULATIVE_TOKENS))
        config._check_common()
        return config

    def _check_suffix_keys_unset(self, method: str) -> None:
        default = SpeculativeConfig()
        for key in SUFFIX_KEYS:
            if getattr(self, key) != getattr(default, key):
                raise ConfigError(f"speculative_config: {key} is the suffix method's; the {method} method does "
                                  "not read it")

    def _check_common(self) -> None:
        k = self.num_speculative_tokens
        if k is None or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"speculative_config: num_speculative_tokens must be 1 to {MAX_SPECULATIVE_TOKENS} "
                              f"(got {k})")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ConfigError(f"speculative_config: disable_by_batch_size must be 1 or more "
                              f"(got {self.disable_by_batch_size})")


def _infer_method(model: str | None) -> str | None:
    """vLLM's inference from "model" alone: "[ngram]", a head named eagle3, else a draft model."""
    if model is None:
        return None
    if model == NGRAM_MODEL:
        return "ngram"
    return "eagle3" if "eagle3" in model.lower() else "draft_model"


def parse_speculative_config(value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A flag's JSON text, a deployment's dict or None -> a validated config (None: no speculation)."""
    if value is None or value == "" or isinstance(value, SpeculativeConfig):
        return value.validate() if isinstance(value, SpeculativeConfig) else None
    value = json_object("speculative_config", value, "{\"method\": \"ngram\", \"num_speculative_tokens\": 4}")
    return struct_of("speculative_config", value, SpeculativeConfig).validate()
