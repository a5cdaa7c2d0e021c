"""Multi-head self-attention, written out as the textbook defines it.

Vaswani et al. 2017, "Attention Is All You Need", section 3.2:

    Q_i = X W_i^Q,  K_i = X W_i^K,  V_i = X W_i^V                  (per head i)
    head_i = softmax(Q_i K_i^T / sqrt(d_k)) V_i                     (eq. 1)
    MultiHead(X) = Concat(head_1, ..., head_h) W^O

The projections of all heads are held in one ``qkv`` linear layer (as in timm): the same
arithmetic as h separate ``W_i`` matrices stacked side by side.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from vit_mnist.errors import ConfigError


def check_attention_args(*, embed_dim: int, num_heads: int, head_dim: int | None = None) -> None:
    """Raise :class:`ConfigError` (a ``ValueError``) when ``embed_dim`` is not a multiple of
    ``num_heads`` and no ``head_dim`` is given: the split of the width into heads that this
    layer's reshape needs. Each value's own type and range is the settings schema's."""
    if head_dim is None and embed_dim % num_heads != 0:
        divisors = [d for d in range(1, embed_dim + 1) if embed_dim % d == 0 and d <= 64]
        raise ConfigError(
            f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}: each head "
            f"gets embed_dim / num_heads features; pick num_heads from {divisors} "
            f"or an embed_dim that is a multiple of {num_heads}"
        )


def causal_mask(t_q: int, t_k: int, device: torch.device) -> torch.Tensor:
    """(T_q, T_k) bool, True above the diagonal: query i (token i) must not see keys j > i."""
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).triu(1)


class MultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention (Vaswani et al. 2017, eq. 1 and section 3.2.2).

    Args:
        embed_dim: model width D (features per token).
        num_heads: number of heads h.
        head_dim: features per head d_k; default ``embed_dim // num_heads``. Given, the
            heads may use fewer features than the model width (h * d_k < D), as after
            head pruning (Michel et al. 2019, section 4): W^O then maps h * d_k to D.
        qkv_bias: whether the Q, K, V projections have a bias.
        attn_dropout: dropout probability on the attention weights (training only).
        proj_dropout: dropout probability after the output projection W^O.
        causal: if True, token t attends only to tokens <= t: scores above the diagonal
            are set to -inf before the softmax.
        impl: ``"explicit"`` (or ``"auto"``) computes softmax(QK^T/sqrt(d_k))V step by
            step; ``"fused"`` calls :func:`torch.nn.functional.scaled_dot_product_attention`,
            the same numbers (to 1e-5 in float32) without the (T, T) weights in memory.
            Fixed at construction. ``need_weights=True`` always runs the explicit path.

    Shapes:
        input ``x``: (batch, tokens, embed_dim), float32 / bfloat16 / float16.
        output: (batch, tokens, embed_dim), same dtype; with ``need_weights=True`` also the
        attention weights (batch, num_heads, tokens, tokens), rows summing to 1, in float32
        under autocast, else in the input's dtype.

    Raises:
        ConfigError (a ValueError): ``embed_dim`` not divisible by ``num_heads``.
    """

    def __init__(
        self,
        *,
        embed_dim: int,
        num_heads: int,
        head_dim: int | None = None,
        qkv_bias: bool = True,
        attn_dropout: float = 0.0,
        proj_dropout: float = 0.0,
        causal: bool = False,
        impl: str = "explicit",
    ) -> None:
        super().__init__()
        check_attention_args(embed_dim=embed_dim, num_heads=num_heads, head_dim=head_dim)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = head_dim or embed_dim // num_heads
        inner = num_heads * self.head_dim  # width of Concat(head_1, ..., head_h)
        self.scale = 1.0 / math.sqrt(self.head_dim)  # 1 / sqrt(d_k)
        self.causal = causal
        self.impl = impl
        self.fused = impl == "fused"
        self.qkv = nn.Linear(embed_dim, 3 * inner, bias=qkv_bias)  # [W^Q W^K W^V]
        # The softmax is a module of its own so that a forward hook can read the weights.
        self.softmax = nn.Softmax(dim=-1)
        self.attn_dropout = nn.Dropout(attn_dropout)
        self.proj = nn.Linear(inner, embed_dim)  # W^O
        self.proj_dropout = nn.Dropout(proj_dropout)

    def forward(
        self, x: torch.Tensor, need_weights: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        qkv = self.qkv(x)  # (B, T, 3*h*d_k): X W^Q, X W^K, X W^V for all heads at once
        q, k, v = rearrange(qkv, "b t (three h d) -> three b h t d", three=3, h=self.num_heads)
        heads, weights = self.attention(q, k, v, need_weights)  # (B, h, T, d_k): head_i
        out = rearrange(heads, "b h t d -> b t (h d)")  # Concat(head_1, ..., head_h)
        out = self.proj_dropout(self.proj(out))  # ... W^O
        return (out, weights) if need_weights else out

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        need_weights: bool = False,
        fused: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V (eq. 1), every head at once.

        q (B, h, T_q, d_k), k and v (B, h, T_k, d_k) -> the heads (B, h, T_q, d_k) and the
        weights (B, h, T_q, T_k) (None from the fused kernel). Query i is token i, for the
        causal mask (the fused kernel's ``is_causal`` aligns it top-left too, so a single
        query, token 0, sees key 0 only). ``fused``: PyTorch's fused kernel or the
        step-by-step arithmetic; by default the layer's ``impl``.
        """
        if (self.fused if fused is None else fused) and not need_weights:
            dropout = self.attn_dropout.p if self.training else 0.0
            heads = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=self.causal, scale=self.scale
            )
            return heads, None
        scores = q @ k.transpose(-2, -1) * self.scale  # (B, h, T_q, T_k): Q_i K_i^T / sqrt(d_k)
        if self.causal:
            scores = scores.masked_fill(causal_mask(*scores.shape[-2:], q.device), -math.inf)
        if scores.dtype in (torch.bfloat16, torch.float16):
            scores = scores.float()  # under autocast: a bfloat16 softmax loses precision
        weights = self.softmax(scores)  # rows sum to 1
        return self.attn_dropout(weights).to(v.dtype) @ v, weights

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"head_dim={self.head_dim}, causal={self.causal}, impl={self.impl!r}"
        )
