"""Architecture hyper-parameters, read from GGUF metadata or a Hugging Face config.json.

A config.json field that changes what the model computes and is not implemented here is refused
with its name, never ignored; fields that only describe training or the file are listed as such.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from services.worker.quant_scheme import scheme_of
from services.worker.rope import RopeScaling, local_rope_theta, parse_hf_rope, partial_rotary_factor
from services.worker.vision_config import (
    QwenVisionConfig,
    VisionConfig,
    gemma3_text_config,
    qwen25vl_text_config,
)
from shared.config import ConfigError
from shared.models.architectures import ENCODER_ARCHITECTURES, GGUF_ARCHITECTURES
from shared.wire.messages import EmbeddingSpec

# read below (or fixed by the architecture: `architectures`)
_READ = {"architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rope_parameters",
         "rms_norm_eps", "tie_word_embeddings", "attention_bias", "max_position_embeddings", "sliding_window",
         "use_sliding_window", "bos_token_id", "eos_token_id", "hidden_act", "mlp_bias", "layer_types",
         "max_window_layers", "original_max_position_embeddings", "num_local_experts", "num_experts",
         "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
         "hidden_activation", "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping",
         "rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern", "use_bidirectional_attention",
         "is_matryoshka", "matryoshka_dimensions", "partial_rotary_factor", "quantization_config",
         "compression_config"}
# no effect on inference: training settings, the file's own metadata
_INERT = {"model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "use_cache",
          "initializer_range", "attention_dropout", "pad_token_id", "pretraining_tp", "output_attentions",
          "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type", "is_encoder_decoder",
          "chunk_size_feed_forward", "tokenizer_class", "embd_pdrop", "resid_pdrop",
          "output_router_logits", "router_aux_loss_coef", "cache_implementation"}
# a BERT-style encoder's (`BertModel`) own fields, and those that only describe its training
_BERT_READ = {"architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "hidden_act",
              "position_embedding_type", "id2label", "sbert_ce_default_activation_function"}
# a cross-encoder's score: sentence-transformers' activation on its one logit (sigmoid unless it names another)
_CE_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity"}
_BERT_INERT = _INERT | {"hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout",
                        "gradient_checkpointing", "tie_word_embeddings"}  # BertModel has no head to tie
# the activations of the gated MLP: SwiGLU's, and GeGLU's (Gemma)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _refuse_unknown(raw: dict, known: set[str], where: str) -> None:
    """A field with a value that is neither read nor inert would change the computation unseen."""
    unknown = sorted(k for k, v in raw.items() if k not in known and v not in (None, False, [], {}))
    if unknown:
        raise ConfigError(f"{where}: config field(s) {unknown} are not implemented by this engine; refusing to "
                          "serve a model whose computation they would change")


def _check_implemented(raw: dict, where: str) -> None:
    _refuse_unknown(raw, _READ | _INERT, where)
    scheme_of(raw, where)  # a quantized checkpoint's scheme: refused by name where it is not implemented
    act = _activation(raw)
    if act not in ACTIVATIONS:
        key = "hidden_activation" if raw.get("hidden_activation") else "hidden_act"
        raise ConfigError(f"{where}: {key} {act!r} is not implemented ({', '.join(ACTIVATIONS)})")
    if raw.get("use_bidirectional_attention"):
        raise ConfigError(f"{where}: use_bidirectional_attention is not implemented (causal decoders only)")
    if raw.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias is not implemented")
    if raw.get("decoder_sparse_step", 1) != 1 or raw.get("mlp_only_layers"):
        raise ConfigError(f"{where}: decoder_sparse_step and mlp_only_layers (dense layers among the experts' "
                          "layers) are not implemented: every layer routes to experts here")


def _cross_encoder(raw: dict, path: Path) -> dict:
    """A BertForSequenceClassification reranker: one label, its activation, and [SEP]'s id (from the
    tokenizer files beside it) to tell the pair's two texts apart."""
    labels = len(raw.get("id2label") or {0: "LABEL_0"})
    if labels != 1:
        raise ConfigError(f"{path}: a classifier of {labels} labels; /score and /rerank serve a cross-encoder of one")
    named = raw.get("sbert_ce_default_activation_function") or "torch.nn.modules.activation.Sigmoid"
    if named not in _CE_ACTIVATIONS:
        raise ConfigError(f"{path}: sbert_ce_default_activation_function {named!r} is not implemented "
                          f"({', '.join(_CE_ACTIVATIONS)})")
    root = path.parent
    tok_cfg = json.loads((root / "tokenizer_config.json").read_text()) if (root / "tokenizer_config.json").exists() else {}
    sep = tok_cfg.get("sep_token") or "[SEP]"
    sep = sep.get("content") if isinstance(sep, dict) else sep
    tok = json.loads((root / "tokenizer.json").read_text()) if (root / "tokenizer.json").exists() else {}
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    sep_id = added.get(sep, (tok.get("model") or {}).get("vocab", {}).get(sep))
    if sep_id is None:
        raise ConfigError(f"{path}: a cross-encoder needs its tokenizer.json beside it, with {sep!r}")
    return dict(sep_token_id=sep_id, score_activation=_CE_ACTIVATIONS[named])


def _sentence_transformers_pooling(root: Path) -> str:
    """sentence-transformers' pooling module: [CLS] or the mean of the tokens (others refused)."""
    path = root / "1_Pooling" / "config.json"
    if not path.exists():
        return "cls"
    modes = [k.removeprefix("pooling_mode_") for k, v in json.loads(path.read_text()).items()
             if k.startswith("pooling_mode_") and v]
    picked = {"cls_token": "cls", "mean_tokens": "mean"}
    if len(modes) != 1 or modes[0] not in picked:
        raise ConfigError(f"{path}: pooling {modes} is not implemented (one of pooling_mode_cls_token, "
                          "pooling_mode_mean_tokens)")
    return picked[modes[0]]


def _activation(raw: dict) -> str:
    """Gemma names it hidden_activation (and its first configs both, hidden_act the inexact gelu)."""
    return raw.get("hidden_activation") or raw.get("hidden_act") or "silu"


def _gguf_rope_scaling(fields: dict, prefix: str) -> RopeScaling:
    """llama.cpp's rope scaling keys; Llama 3.1+ files say theirs with a rope_freqs tensor instead."""
    kind = fields.get(prefix + "rope.scaling.type", "none")
    if kind == "none":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=float(fields[prefix + "rope.scaling.factor"]))
    raise ConfigError(f"GGUF rope scaling {kind!r} is not implemented (none, linear, or a rope_freqs tensor)")


LAYER_TYPES = ("full_attention", "sliding_attention")


def _sliding_window(raw: dict) -> int | None:
    """Mistral's window (on unless use_sliding_window says otherwise); Qwen2 turns it off by default."""
    if not raw.get("use_sliding_window", True) or not raw.get("sliding_window"):
        return None
    layer_types = raw.get("layer_types")
    if layer_types and all(t == "full_attention" for t in layer_types):
        return None
    return int(raw["sliding_window"])


def _layer_types(raw: dict, architecture: str, window: int | None, where: str) -> list[str]:
    """Which layers attend within the window, as transformers derives them where the config does not
    list them: Qwen2's from max_window_layers on, Gemma 2's every other one, Gemma 3's all but every
    sixth, every layer of the rest (Mistral, Phi-3)."""
    n = raw["num_hidden_layers"]
    if window is None:
        return ["full_attention"] * n
    if raw.get("layer_types"):
        types = list(raw["layer_types"])
        if len(types) != n or set(types) - set(LAYER_TYPES):
            raise ConfigError(f"{where}: layer_types must name {n} layers, each one of {LAYER_TYPES}")
        return types
    if architecture == "Qwen2ForCausalLM":
        return ["sliding_attention" if i >= raw.get("max_window_layers", n) else "full_attention" for i in range(n)]
    if architecture == "Gemma2ForCausalLM":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if architecture == "Gemma3ForCausalLM":
        pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    return ["sliding_attention"] * n


def _gguf_gemma(fields: dict, arch: str) -> dict:
    """What llama.cpp fixes for its gemma2 and gemma3 architectures rather than writes: every other
    layer global (gemma2) or every sixth (gemma3, whose others rotate with a base of 10,000), and
    the 27Bs' query scalar (the width over the heads; the head size for the others)."""
    p = arch + "."
    layers, hidden, heads = fields[p + "block_count"], fields[p + "embedding_length"], fields[p + "attention.head_count"]
    head_dim = fields.get(p + "attention.key_length") or hidden // heads
    pattern, largest = (2, 46) if arch == "gemma2" else (6, 62)
    return dict(hidden_act="gelu_pytorch_tanh", sliding_window=int(fields[p + "attention.sliding_window"]),
                layer_types=["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)],
                local_rope_theta=10000.0 if arch == "gemma3" else None,
                query_pre_attn_scalar=hidden // heads if layers == largest else head_dim,
                attn_logit_softcapping=fields.get(p + "attn_logit_softcapping"),
                final_logit_softcapping=fields.get(p + "final_logit_softcapping"))


def _gguf_phi3(fields: dict, head_dim: int) -> dict:
    """llama.cpp's phi3: a partial rotary as rope.dimension_count, the window (if written) on every
    layer. LongRoPE's factors are tensors, which the loader reads (loader/gguf_file.py)."""
    rotary = int(fields.get("phi3.rope.dimension_count") or head_dim)
    window = fields.get("phi3.attention.sliding_window")
    return dict(rotary_dim=rotary if rotary < head_dim else 0, sliding_window=int(window) if window else None,
                layer_types=["sliding_attention"] * fields["phi3.block_count"] if window else [])


class ModelConfig(msgspec.Struct, kw_only=True):
    architecture: str  # Hugging Face class name, the registry key
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int = 0  # the values of a head that rotate (a partial rotary: Phi-4-mini's 96 of 128); 0: all
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    rope_freq_factors: list[float] | None = None  # a GGUF's rope_freqs tensor: each frequency is divided by its
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    layer_types: list[str] = []  # per layer, one of LAYER_TYPES; empty: all full attention
    bos_token_id: int | None = None
    eos_token_ids: list[int] = []
    num_experts: int = 0  # a mixture of experts in place of each MLP (models/moe.py); 0: a dense MLP
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # an expert's width (Qwen3-MoE); 0: intermediate_size (Mixtral)
    norm_topk_prob: bool = True  # the top-k routing weights renormalized to sum to 1 (Mixtral always)
    hidden_act: str = "silu"  # the gated MLP's activation, one of ACTIVATIONS
    query_pre_attn_scalar: float | None = None  # attention scores scaled by its -1/2 power (Gemma); None: head_dim's
    local_rope_theta: float | None = None  # the sliding layers' own rope base (Gemma 3); None: the global rope
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    attn_logit_softcapping: float | None = None  # attention scores -> cap * tanh(scores / cap) (Gemma 2)
    # Matryoshka-trained embeddings (config.json's is_matryoshka / matryoshka_dimensions, as vLLM reads
    # them): None: not; []: any size up to hidden_size; else those sizes
    matryoshka_dimensions: list[int] | None = None
    # an encoder's (models/bert.py): how its prompt's states become one vector ("cls", "mean"); None: a
    # decoder, pooled by its last token
    pooling: str | None = None
    type_vocab_size: int = 0
    layer_norm_eps: float = 1e-12
    # a cross-encoder's (BertForSequenceClassification): a pair's second text is segment 1 after the
    # first [SEP], and its one logit, through `score_activation`, is the pair's score
    sep_token_id: int | None = None
    score_activation: str | None = None
    # an image-text model's vision tower (Gemma3ForConditionalGeneration's, Qwen2_5_VLForConditionalGeneration's)
    vision: VisionConfig | QwenVisionConfig | None = None
    # M-RoPE (Qwen2.5-VL): the rotary's frequencies in sections turned by a token's time, row and column
    # (three positions per token; a text token's three are equal); empty: one position
    mrope_section: list[int] = []

    def __post_init__(self) -> None:
        # an EOS id past the vocabulary (Phi3Config's default 32000 beside a smaller one) is never
        # sampled; kept, min_tokens' ban of EOS would index past the logits and fail every such request
        self.eos_token_ids = [i for i in self.eos_token_ids if 0 <= i < self.vocab_size]

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelConfig:
        raw = json.loads(Path(path).read_text())
        archs = raw.get("architectures") or []
        if not archs:
            raise ValueError(f"{path}: config.json names no architecture")
        if archs[0] in ENCODER_ARCHITECTURES:
            return cls._from_bert(raw, Path(path))
        if archs[0] == "Gemma3ForConditionalGeneration":
            text = cls.from_hf_dict(gemma3_text_config(raw, str(path)), str(path))
            return msgspec.structs.replace(text, architecture=archs[0],
                                           vision=VisionConfig.from_gemma3(raw, text.hidden_size, str(path)))
        if archs[0] == "Qwen2_5_VLForConditionalGeneration":  # Qwen2 with M-RoPE, and its vision tower
            text, sections = qwen25vl_text_config(raw, str(path))
            config = cls.from_hf_dict(text, str(path))
            vision = QwenVisionConfig.from_qwen25vl(raw, Path(path), config.hidden_size,
                                                    (config.rotary_dim or config.head_dim) // 2, sections)
            return msgspec.structs.replace(config, architecture=archs[0], vision=vision, mrope_section=list(sections))
        return cls.from_hf_dict(raw, str(path))

    @classmethod
    def from_hf_dict(cls, raw: dict, path: str) -> ModelConfig:
        """A decoder's config.json, read (`path` names where it came from, for the messages)."""
        archs = raw.get("architectures") or []
        _check_implemented(raw, str(path))
        rope_theta, rope_scaling = parse_hf_rope(raw, str(path))
        eos = raw.get("eos_token_id")
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        window = _sliding_window(raw)
        return cls(
            architecture=archs[0],
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial_rotary_factor(raw, str(path))) if head_dim else 0,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", archs[0] == "Qwen2ForCausalLM")),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            sliding_window=window,
            layer_types=_layer_types(raw, archs[0], window, str(path)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=[] if eos is None else (eos if isinstance(eos, list) else [eos]),
            num_experts=raw.get("num_local_experts") or raw.get("num_experts") or 0,
            num_experts_per_tok=raw.get("num_experts_per_tok", 0),
            moe_intermediate_size=raw.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(raw.get("norm_topk_prob", archs[0] == "MixtralForCausalLM")),
            hidden_act=_activation(raw),
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
            local_rope_theta=local_rope_theta(raw, str(path)),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            attn_logit_softcapping=raw.get("attn_logit_softcapping"),
            matryoshka_dimensions=(list(raw.get("matryoshka_dimensions") or []) if raw.get("is_matryoshka")
                                   or raw.get("matryoshka_dimensions") else None),
        )

    @classmethod
    def _from_bert(cls, raw: dict, path: Path) -> ModelConfig:
        """A BERT encoder; its pooling from sentence-transformers' 1_Pooling/config.json beside it
        ([CLS] where there is none, as vLLM pools BertModel)."""
        _refuse_unknown(raw, _BERT_READ | _BERT_INERT, str(path))
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ConfigError(f"{path}: hidden_act {raw['hidden_act']!r} is not implemented for BERT (gelu)")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError(f"{path}: position_embedding_type {raw['position_embedding_type']!r} is not "
                              "implemented (absolute)")
        heads = raw["num_attention_heads"]
        classifier = raw["architectures"][0] == "BertForSequenceClassification"
        return cls(architecture=raw["architectures"][0], vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
                   intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"],
                   num_heads=heads, num_kv_heads=heads, head_dim=raw["hidden_size"] // heads,
                   max_position_embeddings=raw.get("max_position_embeddings", 512), hidden_act="gelu",
                   type_vocab_size=raw.get("type_vocab_size", 2), layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
                   pooling="cls" if classifier else _sentence_transformers_pooling(path.parent),
                   **(_cross_encoder(raw, path) if classifier else {}))

    def embedding_spec(self) -> EmbeddingSpec:
        if self.score_activation is not None:
            return EmbeddingSpec(size=1, encoder=True, cross_encoder=True)
        return EmbeddingSpec(size=self.hidden_size, matryoshka=self.matryoshka_dimensions,
                             encoder=self.pooling is not None)

    def window_of(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends within; None where it attends to the whole context."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def exact_context(self) -> tuple[int, str] | None:
        """The longest context computed exactly where a feature not implemented limits it, and why:
        within LongRoPE's original length its short factors are the ones transformers uses."""
        limits = []
        if self.rope_scaling.rope_type == "longrope":
            n = self.rope_scaling.original_max_position_embeddings
            limits.append((n, f"LongRoPE's original context of {n} tokens; its long factors are not implemented"))
        return min(limits) if limits else None

    def limit_context(self, max_model_len: int, configured: bool) -> int:
        """A context the model would compute inexactly is capped at the exact one, and refused when asked for."""
        limit = self.exact_context()
        if limit is None or max_model_len <= limit[0]:
            return max_model_len
        if configured:
            raise ConfigError(f"max_model_len {max_model_len} exceeds {limit[1]}, so contexts are limited to "
                              f"that: set max_model_len <= {limit[0]}")
        return limit[0]

    @classmethod
    def from_gguf_fields(cls, fields: dict, has_output_weight: bool) -> ModelConfig:
        arch = fields["general.architecture"]
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF architecture {arch!r} is not supported; known: {', '.join(GGUF_ARCHITECTURES)}")
        p = f"{arch}."
        architecture, experts = GGUF_ARCHITECTURES[arch], int(fields.get(p + "expert_count") or 0)
        if experts and arch == "llama":  # llama.cpp writes Mixtral as llama, its experts stacked per layer
            architecture = "MixtralForCausalLM"
        elif experts and arch != "qwen3moe":
            raise ValueError(f"GGUF {arch!r} with routed experts ({p}expert_count {experts}) is not supported")
        num_heads = fields[p + "attention.head_count"]
        hidden = fields[p + "embedding_length"]
        # phi3's rope.dimension_count is the rotating part of a head (Phi-4-mini's 96 of 128), not its size
        head_dim = fields.get(p + "attention.key_length") or (
            hidden // num_heads if arch == "phi3" else fields.get(p + "rope.dimension_count", hidden // num_heads))
        eos = fields.get("tokenizer.ggml.eos_token_id")
        vocab = fields.get(p + "vocab_size") or len(fields["tokenizer.ggml.tokens"])
        return cls(
            architecture=architecture,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=fields.get(p + "feed_forward_length", 0),
            num_layers=fields[p + "block_count"],
            num_heads=num_heads,
            num_kv_heads=fields.get(p + "attention.head_count_kv", num_heads),
            head_dim=head_dim,
            rope_theta=float(fields.get(p + "rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(fields, p),
            rms_norm_eps=float(fields.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings=not has_output_weight,
            attention_bias=arch == "qwen2",
            max_position_embeddings=fields.get(p + "context_length", 2048),
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[] if eos is None else [eos],
            # routed experts: llama.cpp renormalizes the top k of both families (Mixtral's and Qwen3-MoE's)
            num_experts=experts, num_experts_per_tok=int(fields.get(p + "expert_used_count") or 0),
            moe_intermediate_size=int(fields.get(p + "expert_feed_forward_length") or 0), norm_topk_prob=True,
            **(_gguf_gemma(fields, arch) if arch.startswith("gemma") else {}),
            **(_gguf_phi3(fields, head_dim) if arch == "phi3" else {}),
        )
