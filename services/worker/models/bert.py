"""BERT-style encoders: bidirectional attention over a whole prompt, pooled by its [CLS] token or the
mean of its tokens (`BertModel`, as sentence-transformers saves its embedders), or scoring a pair
of texts by a classifier on [CLS] (`BertForSequenceClassification`, its cross-encoders)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.model_config import ModelConfig


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(cfg.type_vocab_size, 1), cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
        return self.LayerNorm(x + self.token_type_embeddings(segments))


class _SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)


class _Output(nn.Module):
    """A projection back to the width, then the residual and a LayerNorm (BERT's post-norm)."""

    def __init__(self, cfg: ModelConfig, width: int):
        super().__init__()
        self.dense = nn.Linear(width, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        self.ops = ops  # the backend's (read by the backend, as a decoder layer's); the encoder uses SDPA
        self.num_heads = cfg.num_heads
        self.self = _SelfAttention(cfg)
        self.output = _Output(cfg, cfg.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (proj(x).view(b, n, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.self.query, self.self.key, self.self.value))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        return self.output(attended.transpose(1, 2).reshape(b, n, -1), x)


class _Intermediate(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        self.attention = BertAttention(cfg, ops)
        self.intermediate = _Intermediate(cfg)
        self.output = _Output(cfg, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(F.gelu(self.intermediate.dense(x)), x)  # BERT's exact (erf) GELU


class BertEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, ops) for _ in range(cfg.num_layers))


class Bert(nn.Module):
    """Weights under transformers' own names (`embeddings.*`, `encoder.layer.N.*`), so a checkpoint
    loads as saved. It generates nothing: ModelRunner asks it for `embed` at a prompt's last chunk."""

    is_encoder = True

    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg, ops)

    @property
    def tok_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    @property
    def layers(self) -> nn.ModuleList:
        return self.encoder.layer

    def tie_weights(self) -> None:
        pass  # no output head

    def fuse_projections(self) -> None:
        pass  # SDPA takes q, k and v apart

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{self.config.architecture} is an encoder: it embeds, and generates no tokens")

    def encode(self, input_ids: torch.Tensor, mask: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """input_ids, segments [B, L] (padded), mask [B, L] (True: a real token) -> the last layer's
        states [B, L, H]."""
        x = self.embeddings(input_ids, segments)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x

    @torch.inference_mode()
    def embed(self, prompts: list[list[int]]) -> torch.Tensor:
        """Whole prompts -> one vector each [B, H], pooled by the config's rule (cls or mean)."""
        device = self.embeddings.word_embeddings.weight.device
        longest = max(map(len, prompts))
        ids = torch.zeros(len(prompts), longest, dtype=torch.int64, device=device)
        mask = torch.zeros(len(prompts), longest, dtype=torch.bool, device=device)
        segments = torch.zeros(len(prompts), longest, dtype=torch.int64, device=device)
        sep = self.config.sep_token_id
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
            mask[i, : len(p)] = True
            if sep is not None and sep in p[:-1]:  # a pair: the second text (and its [SEP]) is segment 1
                segments[i, p.index(sep) + 1 : len(p)] = 1
        states = self.encode(ids, mask, segments)
        if self.config.pooling == "cls":
            return self.head(states[:, 0])
        weights = mask.to(states.dtype)[..., None]
        return (states * weights).sum(1) / weights.sum(1)

    def head(self, cls_states: torch.Tensor) -> torch.Tensor:
        return cls_states  # an embedder's vector is the state itself


class _Pooler(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)


class BertCrossEncoder(Bert):
    """A reranker: [CLS] q [SEP] d [SEP] -> BERT's pooler (dense, tanh) -> one logit -> the score
    (sentence-transformers' activation: sigmoid, or none)."""

    def __init__(self, cfg: ModelConfig, ops):
        super().__init__(cfg, ops)
        self.pooler = _Pooler(cfg)
        self.classifier = nn.Linear(cfg.hidden_size, 1)

    def head(self, cls_states: torch.Tensor) -> torch.Tensor:
        logits = self.classifier(torch.tanh(self.pooler.dense(cls_states)))
        return logits.sigmoid() if self.config.score_activation == "sigmoid" else logits
