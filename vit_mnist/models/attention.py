"""Multi-head self-attention, written out as the textbook defines it.

Vaswani et al. 2017, "Attention Is All You Need", section 3.2:

    Q_i = X W_i^Q,  K_i = X W_i^K,  V_i = X W_i^V                  (per head i)
    head_i = softmax(Q_i K_i^T / sqrt(d_k)) V_i                     (eq. 1)
    MultiHead(X) = Concat(head_1, ..., head_h) W^O

The projections of all heads are held in one ``qkv`` linear layer (as in timm), which
is the same arithmetic as h separate ``W_i`` matrices stacked side by side.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn
from torch.autograd.function import once_differentiable

from vit_mnist.errors import ConfigError
from vit_mnist.models import native

AttentionImpl = Literal["auto", "explicit", "fused"]
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "explicit", "fused")

# What `auto` runs on each device type, from measurements (docs/benchmarks.md): on a
# 2-core Zen 5 CPU, training at the default architecture, the explicit path was level with
# scaled_dot_product_attention in float32 within the VM's noise (1 275 against 1 317
# images/s in one run, 1 075 against 1 073 in the one before) and 3.7x faster under bf16
# autocast (2 209 against 602; PyTorch's CPU kernel is written for long sequences, not 17
# or 50 tokens). On CUDA the fused kernels (flash / memory-efficient) avoid writing the
# (T, T) weights to memory.
AUTO_IMPL = {"cuda": "fused"}


def resolve_attention_impl(impl: str, device_type: str) -> str:
    """The path ``impl`` runs on ``device_type`` ("cpu", "cuda", ...): ``auto`` becomes
    ``fused`` on CUDA and ``explicit`` elsewhere; the others are returned as given."""
    return AUTO_IMPL.get(device_type, "explicit") if impl == "auto" else impl


def check_attention_args(*, embed_dim: int, num_heads: int, impl: str = "explicit") -> None:
    """Raise :class:`ConfigError` (a ``ValueError``) for an impossible attention shape.

    Raises:
        ConfigError: ``embed_dim`` or ``num_heads`` is not a positive integer,
            ``embed_dim`` is not a multiple of ``num_heads``, or ``impl`` is unknown.
    """
    for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    if embed_dim % num_heads != 0:
        divisors = [d for d in range(1, embed_dim + 1) if embed_dim % d == 0 and d <= 64]
        raise ConfigError(
            f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}: each head "
            f"gets embed_dim / num_heads features; pick num_heads from {divisors} "
            f"or an embed_dim that is a multiple of {num_heads}"
        )
    if impl not in ATTENTION_IMPLS:
        raise ConfigError(f"attention_impl={impl!r} is unknown; use one of {list(ATTENTION_IMPLS)}")


def _causal_mask(t_q: int, t_k: int, device: torch.device) -> torch.Tensor:
    """(T_q, T_k) bool, True above the diagonal: query i (token i) must not see keys j > i."""
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).triu(1)


class _ExplicitAttention(torch.autograd.Function):
    """softmax(Q K^T * scale) V with a hand-written backward; the explicit path for training.

    The forward is the explicit path's arithmetic, with the scale applied inside the
    Q K^T product (its alpha) instead of to Q: no pass of its own, and for a power-of-2
    sqrt(d_k) the same bits. The backward is the gradient of softmax attention written
    out (P the weights, dO the output's gradient):

        dV = P^T dO,   dP = dO V^T,   dS = P * (dP - rowsum(dP * P)),
        dQ = scale * dS K,   dK = scale * dS^T Q

    It gives autograd's numbers (to float32 rounding, see tests/test_attention.py) with
    fewer passes over memory: it saves the weights once, in the inputs' dtype, so that under
    bf16 autocast neither the float32 weights nor float32 copies of their gradient are
    made; it makes Q, K and V contiguous once instead of once per product; and the scale
    rides in the matrix products instead of a pass of its own.

    Shapes: q (B, h, T_q, d), k and v (B, h, T_k, d) -> (B, h, T_q, d), all one dtype.
    Query i is token i, for the causal mask.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale: float, causal: bool):  # noqa: D102
        b, h, t_q, d = q.shape
        t_k = k.shape[2]
        q = q.reshape(b * h, t_q, d)  # one copy each: they are strided views of qkv
        k = k.reshape(b * h, t_k, d)
        v = v.reshape(b * h, t_k, d)
        scores = torch.baddbmm(
            q.new_empty(b * h, t_q, t_k), q, k.transpose(1, 2), beta=0, alpha=scale
        )  # (B*h, T_q, T_k)
        if causal:
            scores.masked_fill_(_causal_mask(t_q, t_k, q.device), float("-inf"))
        if scores.dtype in (torch.bfloat16, torch.float16):
            # As in the explicit path: the softmax in float32, rounded back for @ V.
            weights = torch.softmax(scores.float(), dim=-1).to(scores.dtype)
        else:
            weights = torch.softmax(scores, dim=-1)
        ctx.save_for_backward(q, k, v, weights)
        ctx.scale = scale
        return torch.bmm(weights, v).view(b, h, t_q, d)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # noqa: D102
        q, k, v, weights = ctx.saved_tensors
        bh, t_q, d = q.shape
        t_k = k.shape[1]
        b = grad_out.shape[0]
        grad_out = grad_out.reshape(bh, t_q, d)
        grad_v = torch.bmm(weights.transpose(1, 2), grad_out)
        grad_weights = torch.bmm(grad_out, v.transpose(1, 2))
        # The softmax's own backward kernel: P * (dP - rowsum(dP * P)) in one pass, with
        # float32 arithmetic inside for bfloat16 inputs.
        grad_scores = torch._softmax_backward_data(grad_weights, weights, -1, weights.dtype)
        scale = ctx.scale
        grad_q = torch.baddbmm(q.new_empty(bh, t_q, d), grad_scores, k, beta=0, alpha=scale)
        grad_k = torch.baddbmm(
            q.new_empty(bh, t_k, d), grad_scores.transpose(1, 2), q, beta=0, alpha=scale
        )
        return (
            grad_q.view(b, -1, t_q, d),
            grad_k.view(b, -1, t_k, d),
            grad_v.view(b, -1, t_k, d),
            None,
            None,
        )


class MultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention with an explicit and a fused path.

    Args:
        embed_dim: model width D (features per token).
        num_heads: number of heads h; ``head_dim = embed_dim // num_heads`` is d_k.
        qkv_bias: whether the Q, K, V projections have a bias.
        attn_dropout: dropout probability on the attention weights (training only).
        proj_dropout: dropout probability on the output projection.
        causal: if True, token t attends only to tokens <= t: scores above the diagonal
            are set to -inf before the softmax.
        impl: ``"explicit"`` computes softmax(QK^T/sqrt(d_k))V step by step;
            ``"fused"`` calls :func:`torch.nn.functional.scaled_dot_product_attention`;
            ``"auto"`` (the default) runs whichever measured faster on the input's
            device type, see :func:`resolve_attention_impl`. Both paths give the same
            numbers (to 1e-5 in float32); a call with ``need_weights=True`` always runs
            the explicit path, because only it materialises the weights. On the CPU the
            explicit path's training step runs in a fused C++ kernel where one can be
            built (:mod:`vit_mnist.models.native`), with the same numbers; set the
            attribute ``native_kernel = False`` to run it on PyTorch operations.

    Shapes:
        input ``x``: (batch, tokens, embed_dim), float32 / bfloat16 / float16.
        output: (batch, tokens, embed_dim), same dtype;
        with ``need_weights=True`` also the attention weights
        (batch, num_heads, tokens, tokens), rows summing to 1.

    Raises:
        ConfigError (a ValueError): impossible ``embed_dim`` / ``num_heads`` / ``impl``.
    """

    # The fused CPU kernel for the explicit path's training step (where it applies). A plain
    # attribute, not a constructor argument: it changes the speed, not the model.
    native_kernel: bool = True

    def __init__(
        self,
        *,
        embed_dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        attn_dropout: float = 0.0,
        proj_dropout: float = 0.0,
        causal: bool = False,
        impl: AttentionImpl = "auto",
    ) -> None:
        super().__init__()
        check_attention_args(embed_dim=embed_dim, num_heads=num_heads, impl=impl)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.causal = causal
        self.impl = impl
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=qkv_bias)
        # The softmax is a module of its own so that a forward hook can read the weights.
        self.softmax = nn.Softmax(dim=-1)
        self.attn_dropout = nn.Dropout(attn_dropout)
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.proj_dropout = nn.Dropout(proj_dropout)
        self._paths = {"explicit": self._explicit, "fused": self._fused}
        self._attend = None if impl == "auto" else self._paths[impl]

    def forward(
        self, x: torch.Tensor, need_weights: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        qkv = self.qkv(x)  # (B, T, 3*D)
        if not need_weights and self._native_kernel(qkv, None):
            out = native.FusedCPUAttention.apply(
                qkv, None, self.num_heads, self.scale, self.causal
            )  # (B, T, D): the heads already concatenated
            return self.proj_dropout(self.proj(out))
        q, k, v = rearrange(qkv, "b t (three h d) -> three b h t d", three=3, h=self.num_heads)
        if need_weights:
            out, weights = self._explicit_weights(q, k, v)
            return self._merge_heads(out), weights
        out, _ = self._path(x.device.type)(q, k, v)
        return self._merge_heads(out)

    def forward_cls(self, x: torch.Tensor) -> torch.Tensor:
        """The attention output for the first token (the CLS token) alone.

        Equal to ``forward(x)[:, :1]``, with a 1-row query: the keys and values still
        come from every token, but the queries, score rows, head outputs and ``W^O`` of
        the other tokens are not computed. With ``causal=True`` the CLS token, token 0,
        attends to itself only, as in :meth:`forward`.

        Shapes: ``x`` (batch, tokens, embed_dim) -> (batch, 1, embed_dim), same dtype.
        """
        d = self.embed_dim
        weight, bias = self.qkv.weight, self.qkv.bias
        q = F.linear(x[:, :1], weight[:d], None if bias is None else bias[:d])  # (B, 1, D)
        kv = F.linear(x, weight[d:], None if bias is None else bias[d:])  # (B, T, 2*D)
        if self._native_kernel(q, kv):
            # (B, 1, D)
            out = native.FusedCPUAttention.apply(q, kv, self.num_heads, self.scale, self.causal)
            return self.proj_dropout(self.proj(out))
        q = rearrange(q, "b t (h d) -> b h t d", h=self.num_heads)
        k, v = rearrange(kv, "b t (two h d) -> two b h t d", two=2, h=self.num_heads)
        out, _ = self._path(x.device.type)(q, k, v)  # (B, h, 1, head_dim)
        return self._merge_heads(out)

    def _native_kernel(self, q_src: torch.Tensor, kv_src: torch.Tensor | None) -> bool:
        """Whether the fused CPU kernel runs this call (see :mod:`~vit_mnist.models.native`):
        the explicit path's training step on the CPU, as in :meth:`_explicit`, eager or
        under ``torch.compile``, which calls it as an opaque operator."""
        return (
            self.native_kernel
            and not torch.jit.is_tracing()
            # An exported program (ONNX) must hold standard operators, not this library's.
            and not torch.compiler.is_exporting()
            and q_src.requires_grad
            and torch.is_grad_enabled()
            and not (self.training and self.attn_dropout.p > 0)
            and q_src.device.type == "cpu"
            and resolve_attention_impl(self.impl, "cpu") == "explicit"
            and native.usable(q_src, kv_src, self.num_heads)
        )

    def _path(self, device_type: str):
        if self._attend is not None:
            return self._attend
        # auto: one dict lookup per call, for a model that moves between devices
        return self._paths[resolve_attention_impl("auto", device_type)]

    def _merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        out = rearrange(out, "b h t d -> b t (h d)")  # Concat(head_1..head_h)
        return self.proj_dropout(self.proj(out))  # W^O

    def _explicit(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The hand-written backward pays only where a backward follows. Attention dropout
        # in training, inference and TorchScript tracing (export) take the step-by-step
        # path: tracing cannot record a Python autograd.Function.
        if (
            q.requires_grad
            and torch.is_grad_enabled()
            and not torch.jit.is_tracing()
            and not (self.training and self.attn_dropout.p > 0)
        ):
            return _ExplicitAttention.apply(q, k, v, self.scale, self.causal), None
        return self._explicit_weights(q, k, v)

    def _explicit_weights(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Scaling q (T x d_k) instead of the scores (T x T) is the same product with
        # fewer multiplications, and exact when sqrt(d_k) is a power of 2.
        scores = (q * self.scale) @ k.transpose(-2, -1)  # (B, h, T, T)
        if self.causal:
            # Query i is token i (forward_cls passes the first query only), so row i
            # masks the keys j > i.
            above = _causal_mask(*scores.shape[-2:], scores.device)
            scores = scores.masked_fill(above, float("-inf"))
        if scores.dtype in (torch.bfloat16, torch.float16):
            # Under autocast: the softmax in float32 is more accurate, and on the CPU
            # twice as fast as PyTorch's bfloat16 kernel; its weights are rounded back
            # for the product with V, as autocast would.
            weights = self.softmax(scores.float())
            return self.attn_dropout(weights).to(v.dtype) @ v, weights
        weights = self.softmax(scores)
        return self.attn_dropout(weights) @ v, weights  # (B, h, T, head_dim)

    def _fused(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.attn_dropout.p if self.training else 0.0,
            is_causal=self.causal,
            scale=self.scale,
        )
        return out, None

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"head_dim={self.head_dim}, causal={self.causal}, impl={self.impl!r}"
        )
