"""The reference ViT's forward pass, run on its own modules with a choice of attention core.

:func:`vit_forward` walks a :class:`~vit_mnist.models.vit.VisionTransformer`'s own
patch embedding, blocks, norms and head (no copy of any weight) and differs from
``VisionTransformer.forward`` in three ways only, none of which changes the numbers
beyond float rounding (tests/test_speed.py):

- the patch embedding is a matrix product on the flattened patches (:func:`embed_forward`),
  the conv's own weight seen as a matrix, because oneDNN's backward of a one-channel
  convolution is slow on AVX2 CPUs (docs/speed.md);
- the attention core softmax(Q K^T / sqrt(d_k)) V is a function passed in: the textbook
  arithmetic, :func:`torch.nn.functional.scaled_dot_product_attention`, or the same
  arithmetic with a hand-written backward (:class:`ExplicitAttention`);
- the last block runs for the CLS token alone: only the CLS token reaches the head
  (ViT eq. 4), so the other tokens' attention rows, W^O, second LayerNorm and MLP in the
  last block are never read.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import rearrange
from torch.autograd.function import once_differentiable

from vit_mnist.models.attention import MultiHeadSelfAttention, causal_mask
from vit_mnist.models.vit import EncoderBlock, VisionTransformer

# (attention module, q, k, v) -> head outputs; q (B, h, T_q, d), k and v (B, h, T_k, d)
# -> (B, h, T_q, d). Query i is token i (for the causal mask).
AttentionCore = Callable[
    [MultiHeadSelfAttention, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


def explicit_core(attn: MultiHeadSelfAttention, q, k, v) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d_k)) V step by step, as :class:`MultiHeadSelfAttention` does."""
    scores = q @ k.transpose(-2, -1) * attn.scale  # (B, h, T_q, T_k)
    if attn.causal:
        scores = scores.masked_fill(causal_mask(*scores.shape[-2:], q.device), -math.inf)
    if scores.dtype in (torch.bfloat16, torch.float16):
        scores = scores.float()
    weights = attn.softmax(scores)
    return attn.attn_dropout(weights).to(v.dtype) @ v


def sdpa_core(attn: MultiHeadSelfAttention, q, k, v) -> torch.Tensor:
    """PyTorch's fused kernel. ``is_causal`` aligns the mask top-left, so a single CLS
    query (token 0) sees key 0 only, as in the explicit path."""
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        dropout_p=attn.attn_dropout.p if attn.training else 0.0,
        is_causal=attn.causal,
        scale=attn.scale,
    )


class ExplicitAttention(torch.autograd.Function):
    """softmax(Q K^T * scale) V with the backward written out (P the weights, dO the
    output's gradient; the softmax gradient as in Bridle 1990):

        dV = P^T dO,   dP = dO V^T,   dS = P * (dP - rowsum(dP * P)),
        dQ = scale * dS K,   dK = scale * dS^T Q

    It saves only Q, K, V and the weights P (in the inputs' dtype, so under bf16 autocast
    no float32 copy of P is kept), makes Q, K, V contiguous once, folds the scale into
    the matrix products' alpha instead of a pass of its own, and runs the float32 softmax
    and the softmax backward in place, over the scores and over dP.

    Shapes: q (B, h, T_q, d), k and v (B, h, T_k, d) -> (B, h, T_q, d), all one dtype.
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
            scores.masked_fill_(causal_mask(t_q, t_k, q.device), float("-inf"))
        if scores.dtype in (torch.bfloat16, torch.float16):
            # As the explicit path: the softmax in float32, rounded back for @ V.
            weights = torch.softmax(scores.float(), dim=-1).to(scores.dtype)
        else:
            # In place: the scores are not needed again, and filling a fresh
            # (B*h, T_q, T_k) buffer costs more than the softmax itself (docs/speed.md).
            weights = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
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
        # A single query (the CLS-only last block) makes dV and dK outer products: one
        # multiply each, where a batched matrix product with an inner size of 1 spends its
        # time setting up each tiny matrix. Not in bf16, where the product rounds before the scale
        # is applied and would land a step away from the matrix product's one rounding.
        outer = t_q == 1 and q.dtype in (torch.float32, torch.float64)
        if outer:
            grad_v = weights.transpose(1, 2) * grad_out
        else:
            grad_v = torch.bmm(weights.transpose(1, 2), grad_out)
        grad_weights = torch.bmm(grad_out, v.transpose(1, 2))
        # The softmax's own backward kernel: P * (dP - rowsum(dP * P)) in one pass, written
        # over dP, which nothing else reads.
        grad_scores = torch.ops.aten._softmax_backward_data.out(
            grad_weights, weights, -1, weights.dtype, grad_input=grad_weights
        )
        scale = ctx.scale
        grad_q = torch.baddbmm(q.new_empty(bh, t_q, d), grad_scores, k, beta=0, alpha=scale)
        if outer:
            grad_k = torch.mul(grad_scores.transpose(1, 2), q).mul_(scale)
        else:
            grad_k = torch.baddbmm(
                q.new_empty(bh, t_k, d), grad_scores.transpose(1, 2), q, beta=0, alpha=scale
            )
        shape = (b, -1)
        return (
            grad_q.view(*shape, t_q, d),
            grad_k.view(*shape, t_k, d),
            grad_v.view(*shape, t_k, d),
            None,
            None,
        )


def handwritten_backward_core(attn: MultiHeadSelfAttention, q, k, v) -> torch.Tensor:
    """:class:`ExplicitAttention` where a backward follows and no attention dropout is
    drawn; the explicit arithmetic otherwise (inference, dropout, tracing)."""
    if (
        torch.is_grad_enabled()
        and q.requires_grad
        and not torch.jit.is_tracing()
        and not (attn.training and attn.attn_dropout.p > 0)
    ):
        return ExplicitAttention.apply(q, k, v, attn.scale, attn.causal)
    return explicit_core(attn, q, k, v)


def cls_query_and_keys(
    attn: MultiHeadSelfAttention, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CLS token's query (B, 1, h*d_k) and every token's keys and values
    (B, T, 2*h*d_k), from the rows of ``attn.qkv`` that make them: the other tokens'
    queries are never computed. (h * d_k is D except in a model with pruned heads.)"""
    d = attn.num_heads * attn.head_dim
    weight, bias = attn.qkv.weight, attn.qkv.bias
    q = F.linear(x[:, :1], weight[:d], None if bias is None else bias[:d])
    kv = F.linear(x, weight[d:], None if bias is None else bias[d:])
    return q, kv


def attention_forward(
    attn: MultiHeadSelfAttention, x: torch.Tensor, core: AttentionCore, cls_only: bool = False
) -> torch.Tensor:
    """``attn(x)`` with ``core`` for the softmax step; with ``cls_only`` the output for the
    CLS token (token 0) alone: every token's keys and values, the CLS token's query only.

    Shapes: x (B, T, D) -> (B, T, D), or (B, 1, D) with ``cls_only``.
    """
    if cls_only:
        q, kv = cls_query_and_keys(attn, x)
        q = rearrange(q, "b t (h d) -> b h t d", h=attn.num_heads)
        k, v = rearrange(kv, "b t (two h d) -> two b h t d", two=2, h=attn.num_heads)
    else:
        qkv = attn.qkv(x)
        q, k, v = rearrange(qkv, "b t (three h d) -> three b h t d", three=3, h=attn.num_heads)
    out = rearrange(core(attn, q, k, v), "b h t d -> b t (h d)")
    return attn.proj_dropout(attn.proj(out))


def block_forward(
    block: EncoderBlock, x: torch.Tensor, core: AttentionCore, cls_only: bool = False
) -> torch.Tensor:
    """``block(x)`` (ViT eq. 2-3) with ``core``; with ``cls_only`` the CLS row alone."""
    attn_out = attention_forward(block.attn, block.norm1(x), core, cls_only)
    x = _residual(x[:, :1] if cls_only else x, block.drop_path(attn_out))
    return _residual(x, block.drop_path(block.mlp(block.norm2(x))))


def _residual(x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """``x + branch``, written over ``branch`` where their dtypes agree: a branch's output is
    a fresh tensor that autograd does not save (it would refuse the in-place add if it
    did), and a fresh activation-sized buffer costs more to fill than the add
    (docs/speed.md). Under bf16 autocast a bf16 branch meets a float32 residual stream and
    the sum is a new float32 tensor, as in the reference."""
    return branch.add_(x) if branch.dtype == x.dtype else x + branch


def embed_forward(net: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """``net._embed(x)``, ViT eq. 1 as written: each patch flattened, times E, where E is
    the patch embedding's conv weight (D, C, p, p) seen as a (D, C*p*p) matrix.

    Shapes: images (B, C, img_size, img_size) -> tokens (B, 1 + num_patches, D), CLS first.

    Raises:
        ValueError: images of another size than the model's ``img_size``.
    """
    embed = net.patch_embed
    if x.shape[-2:] != (embed.img_size, embed.img_size):
        return net._embed(x)  # raises, naming both sizes
    p = embed.patch_size
    patches = rearrange(x, "b c (gh p1) (gw p2) -> b (gh gw) (c p1 p2)", p1=p, p2=p)
    tokens = F.linear(patches, embed.proj.weight.flatten(1), embed.proj.bias)  # (B, N, D)
    cls = net.cls_token.expand(tokens.shape[0], -1, -1)
    return net.pos_drop(torch.cat([cls, tokens], dim=1) + net.pos_embed)


def vit_forward(
    net: VisionTransformer, x: torch.Tensor, core: AttentionCore = explicit_core
) -> torch.Tensor:
    """``net(x)``: images (B, C, H, W) -> logits (B, num_classes), with ``core`` in every
    block and the last block for the CLS token only."""
    x = embed_forward(net, x)
    for block in net.blocks[:-1]:
        x = block_forward(block, x, core)
    x = block_forward(net.blocks[-1], x, core, cls_only=True)
    return net.forward_head(net.norm(x))
