"""A minimal GPT: token and position embeddings, pre-LN blocks (causal self-attention, MLP), an LM head.

Used by the main training job (``examples/train_gpt.py``), the DDP step benchmark
and the DDP tests.

    >>> model = GPT(GPTConfig(vocab_size=1000, context=64, d_model=128, n_layers=2, n_heads=4))
    >>> logits = model(tokens)                 # tokens: (batch, time) int64 -> (batch, time, vocab)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "synthetic_batch"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the model."""

    vocab_size: int = 1000
    """Number of token ids."""
    context: int = 64
    """Longest sequence (number of positions)."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads per block; must divide ``d_model``."""
    mlp_ratio: int = 4
    """Hidden width of the MLP, as a multiple of ``d_model``."""
    tie_weights: bool = False
    """Share the token embedding with the output head (tied weights)."""

    def __post_init__(self) -> None:
        for field in ("vocab_size", "context", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{field}: must be an integer >= 1, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig.n_heads: {self.n_heads} does not divide d_model={self.d_model}")

    @property
    def num_parameters(self) -> int:
        """Parameter count of a ``GPT`` built from this config."""
        d, v = self.d_model, self.vocab_size
        block = 2 * (2 * d) + (3 * d * d + 3 * d) + (d * d + d)
        block += self.mlp_ratio * d * d + self.mlp_ratio * d + self.mlp_ratio * d * d + d
        head = 0 if self.tie_weights else v * d
        return v * d + self.context * d + self.n_layers * block + 2 * d + head


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(batch, time, vocab)`` for ``tokens`` of shape ``(batch, time)``."""
        t = tokens.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"GPT: sequence of {t} tokens is longer than the context ({self.cfg.context})")
        pos = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of next-token predictions."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batch(
    cfg: GPTConfig, batch_size: int, *, seed: int, step: int, noise: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch of a learnable language: each token is followed by a fixed successor.

    The successor of token ``i`` is ``perm[i]`` for a permutation fixed by ``seed``;
    with probability ``noise`` a token is replaced by a random one, so the loss falls
    from ``ln(vocab)`` towards a floor set by the noise. The same ``(seed, step)``
    gives the same batch in every process.

    Returns:
        ``(inputs, targets)``, each ``(batch_size, context)`` int64; targets are the
        inputs shifted by one.
    """
    perm = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    seq = torch.empty(batch_size, cfg.context + 1, dtype=torch.int64)
    seq[:, 0] = torch.randint(cfg.vocab_size, (batch_size,), generator=gen)
    for t in range(1, cfg.context + 1):
        seq[:, t] = perm[seq[:, t - 1]]
    flip = torch.rand(seq.shape, generator=gen) < noise
    seq[flip] = torch.randint(cfg.vocab_size, (int(flip.sum()),), generator=gen)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
