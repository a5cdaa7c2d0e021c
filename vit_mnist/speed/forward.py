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
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch.autograd.function import once_differentiable

from vit_mnist.models.attention import MultiHeadSelfAttention, causal_mask
from vit_mnist.models.vit import EncoderBlock, VisionTransformer

# (attention module, q_src, kv_src) -> Concat(head_1..head_h), (B, T_q, h*d_k), ready for
# W^O. q_src is the packed projection (B, T, 3*h*d_k), Q, K and V side by side and heads
# within each (as ``MultiHeadSelfAttention.qkv`` makes it), when kv_src is None; otherwise
# q_src holds the queries (B, T_q, h*d_k) and kv_src the keys and values (B, T_k, 2*h*d_k).
# Query i is token i (for the causal mask).
AttentionCore = Callable[[MultiHeadSelfAttention, torch.Tensor, torch.Tensor | None], torch.Tensor]


def split_heads(
    q_src: torch.Tensor, kv_src: torch.Tensor | None, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q (B, h, T_q, d_k), K and V (B, h, T_k, d_k) as views of a core's inputs (see
    :data:`AttentionCore`)."""
    if kv_src is None:
        q, k, v = rearrange(q_src, "b t (three h d) -> three b h t d", three=3, h=num_heads)
        return q, k, v
    q = rearrange(q_src, "b t (h d) -> b h t d", h=num_heads)
    k, v = rearrange(kv_src, "b t (two h d) -> two b h t d", two=2, h=num_heads)
    return q, k, v


def explicit_core(
    attn: MultiHeadSelfAttention, q_src: torch.Tensor, kv_src: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d_k)) V step by step, as :class:`MultiHeadSelfAttention` does."""
    q, k, v = split_heads(q_src, kv_src, attn.num_heads)
    scores = q @ k.transpose(-2, -1) * attn.scale  # (B, h, T_q, T_k)
    if attn.causal:
        scores = scores.masked_fill(causal_mask(*scores.shape[-2:], q.device), -math.inf)
    if scores.dtype in (torch.bfloat16, torch.float16):
        scores = scores.float()
    weights = attn.softmax(scores)
    return rearrange(attn.attn_dropout(weights).to(v.dtype) @ v, "b h t d -> b t (h d)")


def sdpa_core(
    attn: MultiHeadSelfAttention, q_src: torch.Tensor, kv_src: torch.Tensor | None = None
) -> torch.Tensor:
    """PyTorch's fused kernel. ``is_causal`` aligns the mask top-left, so a single CLS
    query (token 0) sees key 0 only, as in the explicit path."""
    q, k, v = split_heads(q_src, kv_src, attn.num_heads)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        dropout_p=attn.attn_dropout.p if attn.training else 0.0,
        is_causal=attn.causal,
        scale=attn.scale,
    )
    return rearrange(out, "b h t d -> b t (h d)")


class ExplicitAttention(torch.autograd.Function):
    """softmax(Q K^T * scale) V with the backward written out (P the weights, dO the
    output's gradient; the softmax gradient as in Bridle 1990):

        dV = P^T dO,   dP = dO V^T,   dS = P * (dP - rowsum(dP * P)),
        dQ = scale * dS K,   dK = scale * dS^T Q

    It takes the projections packed and returns their gradients packed, so autograd has
    no per-head views to undo: dQ, dK and dV are written side by side into one buffer and
    laid out as the projection's output by one copy, where autograd would stack them and
    copy again. It saves only Q, K, V and the weights P (in the inputs' dtype, so under
    bf16 autocast no float32 copy of P is kept), makes Q, K, V contiguous once, folds the
    scale into the matrix products' alpha instead of a pass of its own, and runs the
    float32 softmax and the softmax backward in place, over the scores and over dP.

    Inputs as an :data:`AttentionCore`'s (one dtype); output (B, T_q, h*d_k), heads
    concatenated.
    """

    @staticmethod
    def forward(ctx, q_src, kv_src, num_heads: int, scale: float, causal: bool):  # noqa: D102
        q, k, v = split_heads(q_src, kv_src, num_heads)
        b, h, t_q, d = q.shape
        t_k = k.shape[2]
        q = q.reshape(b * h, t_q, d)  # one copy each: they are strided views of the input
        k = k.reshape(b * h, t_k, d)
        v = v.reshape(b * h, t_k, d)
        scores = q.new_empty(b * h, t_q, t_k)  # (B*h, T_q, T_k)
        # out= the input itself: without it PyTorch's CPU baddbmm ran 4 to 6 times slower
        # than this call at (1024, 50, 50) (docs/speed.md).
        torch.baddbmm(scores, q, k.transpose(1, 2), beta=0, alpha=scale, out=scores)
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
        ctx.packed = kv_src is None
        return rearrange(torch.bmm(weights, v), "(b h) t d -> b t (h d)", b=b)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # noqa: D102
        q, k, v, weights = ctx.saved_tensors
        bh, t_q, d = q.shape
        t_k = k.shape[1]
        b = grad_out.shape[0]
        grad_out = rearrange(grad_out, "b t (h d) -> (b h) t d", b=b, d=d).contiguous()
        # The gradients of what the input packs, side by side: (dQ, dK, dV), or (dK, dV)
        # with dQ apart when the queries came on their own.
        if ctx.packed:
            grads = q.new_empty(3, bh, t_k, d)
            grad_q, grad_k, grad_v = grads.unbind(0)
        else:
            grads = q.new_empty(2, bh, t_k, d)
            grad_k, grad_v = grads.unbind(0)
            grad_q = q.new_empty(bh, t_q, d)
        # A single query (the CLS-only last block) makes dV and dK outer products: one
        # multiply each, where a batched matrix product with an inner size of 1 spends its
        # time setting up each tiny matrix. Not in bf16, where the product rounds before the scale
        # is applied and would land a step away from the matrix product's one rounding.
        outer = t_q == 1 and q.dtype in (torch.float32, torch.float64)
        if outer:
            torch.mul(weights.transpose(1, 2), grad_out, out=grad_v)
        else:
            torch.bmm(weights.transpose(1, 2), grad_out, out=grad_v)
        grad_weights = torch.bmm(grad_out, v.transpose(1, 2))
        # The softmax's own backward kernel: P * (dP - rowsum(dP * P)) in one pass, written
        # over dP, which nothing else reads.
        grad_scores = torch.ops.aten._softmax_backward_data.out(
            grad_weights, weights, -1, weights.dtype, grad_input=grad_weights
        )
        scale = ctx.scale
        # beta=0: the uninitialised buffer is not read.
        torch.baddbmm(grad_q, grad_scores, k, beta=0, alpha=scale, out=grad_q)
        if outer:
            torch.mul(grad_scores.transpose(1, 2), q, out=grad_k).mul_(scale)
        else:
            torch.baddbmm(grad_k, grad_scores.transpose(1, 2), q, beta=0, alpha=scale, out=grad_k)
        grad_packed = rearrange(grads, "n (b h) t d -> b t (n h d)", b=b)  # the one copy
        if ctx.packed:
            return grad_packed, None, None, None, None
        grad_q_src = rearrange(grad_q, "(b h) t d -> b t (h d)", b=b)
        return grad_q_src, grad_packed, None, None, None


def handwritten_backward_core(
    attn: MultiHeadSelfAttention, q_src: torch.Tensor, kv_src: torch.Tensor | None = None
) -> torch.Tensor:
    """:class:`ExplicitAttention` where a backward follows and no attention dropout is
    drawn; the explicit arithmetic otherwise (inference, dropout, tracing)."""
    if written_backward_applies(attn, q_src, kv_src):
        return ExplicitAttention.apply(q_src, kv_src, attn.num_heads, attn.scale, attn.causal)
    return explicit_core(attn, q_src, kv_src)


def written_backward_applies(
    attn: MultiHeadSelfAttention, q_src: torch.Tensor, kv_src: torch.Tensor | None
) -> bool:
    """Whether a core with its own backward may take these inputs: a backward follows
    (gradients on, an input that needs one, not tracing) and no attention dropout is drawn
    (the written-out backward has none)."""
    return (
        torch.is_grad_enabled()
        and (q_src.requires_grad or (kv_src is not None and kv_src.requires_grad))
        and not torch.jit.is_tracing()
        and not (attn.training and attn.attn_dropout.p > 0)
    )


def cls_query_and_keys(
    attn: MultiHeadSelfAttention, x: torch.Tensor, queries: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``queries`` tokens' queries (B, queries, h*d_k): the CLS token's (and a
    distillation token's), and every token's keys and values (B, T, 2*h*d_k), from the rows
    of ``attn.qkv`` that make them: the other tokens' queries are never computed. (h * d_k
    is D except in a model with pruned heads.)"""
    d = attn.num_heads * attn.head_dim
    weight, bias = attn.qkv.weight, attn.qkv.bias
    q = F.linear(x[:, :queries], weight[:d], None if bias is None else bias[:d])
    kv = F.linear(x, weight[d:], None if bias is None else bias[d:])
    return q, kv


def attention_forward(
    attn: MultiHeadSelfAttention, x: torch.Tensor, core: AttentionCore, queries: int = 0
) -> torch.Tensor:
    """``attn(x)`` with ``core`` for the softmax step; with ``queries`` > 0 the output for
    the first ``queries`` tokens alone (the CLS token, and a distillation token): every
    token's keys and values, their queries only.

    Shapes: x (B, T, D) -> (B, T, D), or (B, queries, D).
    """
    if queries:
        q_src, kv_src = cls_query_and_keys(attn, x, queries)
    else:
        q_src, kv_src = attn.qkv(x), None
    return attn.proj_dropout(attn.proj(core(attn, q_src, kv_src)))


def block_forward(
    block: EncoderBlock, x: torch.Tensor, core: AttentionCore, queries: int = 0
) -> torch.Tensor:
    """``block(x)`` (ViT eq. 2-3) with ``core``; with ``queries`` > 0 the first rows alone."""
    attn_out = attention_forward(block.attn, block.norm1(x), core, queries)
    x = _residual(x[:, :queries] if queries else x, block.drop_path(attn_out))
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

    Shapes: images (B, C, img_size, img_size) -> tokens (B, num_tokens, D), CLS first.

    Raises:
        ValueError: images of another size than the model's ``img_size``.
    """
    embed = net.patch_embed
    if x.shape[-2:] != (embed.img_size, embed.img_size):
        return net._embed(x)  # raises, naming both sizes
    p = embed.patch_size
    patches = rearrange(x, "b c (gh p1) (gw p2) -> b (gh gw) (c p1 p2)", p1=p, p2=p)
    tokens = F.linear(patches, embed.proj.weight.flatten(1), embed.proj.bias)  # (B, N, D)
    tokens = torch.cat([*net.prefix_tokens(tokens.shape[0]), tokens], dim=1)
    return net.pos_drop(tokens + net.pos_embed)


def vit_forward(
    net: VisionTransformer,
    x: torch.Tensor,
    core: AttentionCore = explicit_core,
    heads: bool = False,
) -> Any:
    """``net(x)``: images (B, C, H, W) -> logits (B, num_classes), with ``core`` in every
    block and the last block for the CLS (and distillation) token only; with ``heads`` the
    pair ``net.forward_heads`` gives (a distillation's loss needs both)."""
    x = embed_forward(net, x)
    for block in net.blocks[:-1]:
        x = block_forward(block, x, core)
    x = net.norm(block_forward(net.blocks[-1], x, core, queries=net.num_prefix_tokens))
    return net.forward_heads(x) if heads else net.forward_head(x)
