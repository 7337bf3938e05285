"""An EAGLE-3 draft head (Li et al. 2025) as vLLM's `speculators` writes it: one Llama layer over
[the token's embedding, the target's fused hidden states], drafting from a pruned vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from services.worker.backends.base import LayerOps
from services.worker.model_config import ModelConfig
from services.worker.models.llama import Attention, FeedForward, Llama, RMSNorm, Rotary
from shared.config import ConfigError

# the head's options this file computes, and the keys of speculators' config that change nothing at
# inference; any other key with a value is refused by name (a field read by nobody would change the
# computation unseen)
_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
_READ = {"speculators_model_type", "transformer_layer_config", "draft_vocab_size", "target_hidden_size",
         "eagle_aux_hidden_state_layer_ids", *_FLAGS}
_INERT = {"architectures", "auto_map", "dtype", "torch_dtype", "embed_requires_grad", "speculators_config",
          "speculators_version", "transformers_version", "tie_word_embeddings", "has_no_defaults_at_init"}


def aux_layer_ids(config: dict, num_target_layers: int) -> list[int]:
    """The target layers whose input (the residual stream entering them; num_layers: after the last)
    the head reads: the config's, else speculators' and vLLM's default (2, L // 2, L - 3)."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or [2, num_target_layers // 2, num_target_layers - 3]
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) > num_target_layers:
        raise ConfigError(f"speculative_config: the EAGLE-3 head reads the target's layers {ids}, which a model of "
                          f"{num_target_layers} layers does not have (distinct, 0 to {num_target_layers})")
    return ids


class Eagle3Head(nn.Module):
    """forward(token ids, positions, hidden [T, H], KV, meta) -> (the hidden state fed to its next
    position, the normed state its logits come from). `hidden` is fuse(target's aux states) where the
    target computed the position, else the head's own output at the position before."""

    def __init__(self, cfg: ModelConfig, ops: LayerOps, *, num_aux: int, target_hidden: int, draft_vocab: int,
                 flags: dict[str, bool]):
        super().__init__()
        self.config = cfg
        self.flags = flags
        self.draft_vocab = draft_vocab
        hidden = cfg.hidden_size
        self.fc = nn.Linear(num_aux * target_hidden, hidden, bias=False)
        self.input_norm = RMSNorm(num_aux * target_hidden, cfg.rms_norm_eps, ops) if flags["norm_before_fc"] else None
        self.fc_norm = nn.ModuleList(RMSNorm(target_hidden, cfg.rms_norm_eps, ops) for _ in range(num_aux)) \
            if flags["fc_norm"] else None
        self.attention = Attention(cfg, ops, 0)
        # the one layer's q/k/v read the embedding and the hidden state side by side
        self.attention.wq = nn.Linear(2 * hidden, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.attention.wk = nn.Linear(2 * hidden, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.attention.wv = nn.Linear(2 * hidden, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.feed_forward = FeedForward(cfg, ops)
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, ops)
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, ops)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps, ops)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))  # draft id + d2t = target id
        self.embed_tokens: nn.Module | None = None  # the head's own, or the target's (load_eagle3)
        self.rotary = Rotary(cfg)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux states [T, num_aux * target_hidden] -> the head's hidden input [T, H]."""
        if self.input_norm is not None:
            aux = self.input_norm.alone(aux)
        if self.fc_norm is not None:
            aux = torch.cat([norm.alone(part) for norm, part in zip(self.fc_norm, aux.chunk(len(self.fc_norm), -1),
                                                                     strict=True)], -1)
        return self.fc(aux)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary.cos_sin(positions)
        embeds = self.input_layernorm.alone(self.embed_tokens(input_ids).to(hidden.dtype))
        normed_hidden = self.hidden_norm.alone(hidden)
        residual = normed_hidden if self.flags["norm_before_residual"] else hidden
        attended = self.attention(torch.cat([embeds, normed_hidden], -1), cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm(attended, residual)
        out = self.feed_forward(h) + residual
        normed = self.norm.alone(out)
        return (normed if self.flags["norm_output"] else out), normed

    def draft_tokens(self, normed: torch.Tensor) -> list[int]:
        """The greedy draft of each row, as a target token id."""
        best = self.lm_head(normed).float().argmax(-1)
        return (best + self.d2t[best]).tolist()


def load_eagle3(path: str, target: nn.Module, target_config: ModelConfig, ops: LayerOps,
                dtype: torch.dtype) -> tuple[Eagle3Head, list[int]]:
    """The head in a speculators checkpoint folder (config.json's speculators_model_type "eagle3",
    model.safetensors), and the target layers it reads; the target's embeddings where it has none."""
    root = Path(path)
    where = f"speculative_config: {path}"
    try:
        raw = json.loads((root / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: no EAGLE-3 head's config.json ({exc})") from None
    if raw.get("speculators_model_type") != "eagle3":
        raise ConfigError(f"{where}: not an EAGLE-3 head in the speculators format (its config.json's "
                          f"speculators_model_type is {raw.get('speculators_model_type')!r}, not 'eagle3')")
    unknown = sorted(k for k, v in raw.items() if k not in _READ | _INERT and v not in (None, False, [], {}))
    if unknown:
        raise ConfigError(f"{where}: the head's config sets {unknown}, which this engine does not compute")
    layer = dict(raw.get("transformer_layer_config") or {})
    if layer.get("model_type", "llama") != "llama":
        raise ConfigError(f"{where}: a head of {layer.get('model_type')!r} layers; heads of Llama layers run here")
    if layer.get("num_hidden_layers", 1) != 1:
        raise ConfigError(f"{where}: a head of {layer['num_hidden_layers']} layers; heads of one layer run here")
    layer.setdefault("architectures", ["LlamaForCausalLM"])
    cfg = ModelConfig.from_hf_dict({k: v for k, v in layer.items() if k != "num_hidden_layers"} | {"num_hidden_layers": 1},
                                   where)
    if type(target).forward is not Llama.forward:
        raise ConfigError(f"{where}: EAGLE-3 reads the target's layers as Llama's forward runs them; "
                          f"{target_config.architecture} runs its own")
    target_hidden = raw.get("target_hidden_size") or target_config.hidden_size
    if target_hidden != target_config.hidden_size or cfg.vocab_size != target_config.vocab_size:
        raise ConfigError(f"{where}: a head for a model of hidden size {target_hidden} and {cfg.vocab_size} tokens; "
                          f"this model's are {target_config.hidden_size} and {target_config.vocab_size}")
    ids = aux_layer_ids(raw, target_config.num_layers)
    flags = {name: bool(raw.get(name, False)) for name in _FLAGS}
    head = Eagle3Head(cfg, ops, num_aux=len(ids), target_hidden=target_hidden,
                      draft_vocab=raw.get("draft_vocab_size") or cfg.vocab_size, flags=flags)
    weights = _read(root)
    own_embeddings = weights.pop("embed_tokens.weight", None)
    if own_embeddings is None and cfg.hidden_size != target_config.hidden_size:
        raise ConfigError(f"{where}: the head has no embeddings, and the model's are of another width")
    missing, unexpected = head.load_state_dict({_ours(k): v for k, v in weights.items() if k != "t2d"}, strict=False)
    missing = [m for m in missing if m not in ("d2t", "rotary.inv_freq") and not m.startswith("embed_tokens")]
    if missing or unexpected:
        raise ConfigError(f"{where}: weights missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    head.to(dtype)  # d2t stays int64 (a cast moves floating tensors only)
    head.rotary = Rotary(cfg)  # in float32, as the target's
    head.attention.fuse()
    head.feed_forward.fuse()
    head.embed_tokens = nn.Embedding.from_pretrained(own_embeddings.to(dtype)) if own_embeddings is not None \
        else target.tok_embeddings
    return head.requires_grad_(False).eval(), ids


_NAMES = {"layers.0.self_attn.q_proj": "attention.wq", "layers.0.self_attn.k_proj": "attention.wk",
          "layers.0.self_attn.v_proj": "attention.wv", "layers.0.self_attn.o_proj": "attention.wo",
          "layers.0.mlp.gate_proj": "feed_forward.w1", "layers.0.mlp.down_proj": "feed_forward.w2",
          "layers.0.mlp.up_proj": "feed_forward.w3", "layers.0.input_layernorm": "input_layernorm",
          "layers.0.hidden_norm": "hidden_norm", "layers.0.post_attention_layernorm": "post_attention_layernorm"}


def _ours(name: str) -> str:
    module, _, leaf = name.rpartition(".")
    return f"{_NAMES.get(module, module)}.{leaf}" if module else name


def _read(root: Path) -> dict[str, torch.Tensor]:
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"speculative_config: {root}: no *.safetensors files")
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            out.update((name, f.get_tensor(name)) for name in f.keys())
    return out

