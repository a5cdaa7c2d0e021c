"""The reference ViT's forward pass, run on its own modules, for the ``compile`` and ``native``
paths.

:func:`vit_forward` (compiled by the ``compile`` path) walks a
:class:`~vit_mnist.models.vit.VisionTransformer`'s own patch embedding, blocks, norms and
head (no copy of any weight) and differs from ``VisionTransformer.forward`` in three ways
only, none of which changes the numbers beyond float rounding (tests/test_speed.py):

- the patch embedding is a matrix product on the flattened patches (:func:`embed_forward`),
  the conv's own weight seen as a matrix, because oneDNN's backward of a one-channel
  convolution is slow on AVX2 CPUs (docs/speed.md);
- the attention core softmax(Q K^T / sqrt(d_k)) V is a function passed in: the textbook
  arithmetic (:func:`explicit_core`) or the C++ kernel (:func:`native_core`);
- the last block runs for the CLS token alone: only the CLS token reaches the head
  (ViT eq. 4), so the other tokens' attention rows, W^O, second LayerNorm and MLP in the
  last block are never read.

:func:`native_vit_forward` is the same forward on the C++ kernels of
:mod:`vit_mnist.speed.native`. Where a kernel cannot take an input (a shape it was not
built for, attention dropout in training, tracing), that step runs on PyTorch's
operations, with the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from vit_mnist.models.attention import MultiHeadSelfAttention, causal_mask
from vit_mnist.models.vit import EncoderBlock, VisionTransformer
from vit_mnist.speed import native

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


def kernel_applies(
    attn: MultiHeadSelfAttention, q_src: torch.Tensor, kv_src: torch.Tensor | None
) -> bool:
    """Whether the C++ kernel may take these inputs: a backward follows (gradients on, an
    input that needs one, not tracing) and no attention dropout is drawn (the kernel's
    backward has none). Else the explicit arithmetic runs, nothing saved for a backward."""
    return (
        torch.is_grad_enabled()
        and (q_src.requires_grad or (kv_src is not None and kv_src.requires_grad))
        and not torch.jit.is_tracing()
        and not (attn.training and attn.attn_dropout.p > 0)
    )


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
        q_src, kv_src = cls_query_and_keys(attn, x)
    else:
        q_src, kv_src = attn.qkv(x), None
    return attn.proj_dropout(attn.proj(core(attn, q_src, kv_src)))


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


# The same forward on the C++ kernels (the ``native`` path): every residual add and the
# LayerNorm that reads its sum run as one pass each way, so a block hands its MLP branch to
# the next block un-added (:func:`_block_deferred`), where ``x + branch`` meets ``norm1``.


def native_core(
    attn: MultiHeadSelfAttention, q_src: torch.Tensor, kv_src: torch.Tensor | None = None
) -> torch.Tensor:
    """An :data:`~vit_mnist.speed.forward.AttentionCore`: the attention kernel where it
    applies, the explicit arithmetic otherwise.

    Shapes: q_src (B, T, 3*D) packed, or (B, T_q, D) with kv_src (B, T_k, 2*D) ->
    (B, T_q, D), heads concatenated.
    """
    heads = attn.num_heads
    if kernel_applies(attn, q_src, kv_src) and native.usable(q_src, kv_src, heads):
        return native.FusedCPUAttention.apply(q_src, kv_src, heads, attn.scale, attn.causal)
    return explicit_core(attn, q_src, kv_src)


def _add_norm(
    x: torch.Tensor, branch: torch.Tensor | None, norm: nn.LayerNorm, *, for_linear: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + branch, norm(x + branch))``: one kernel pass where it applies."""
    if torch.is_grad_enabled() and x.requires_grad and native.add_norm_usable(x, branch, norm):
        return native.add_norm(x, branch, norm, for_linear=for_linear)
    if branch is not None:
        x = x + branch
    return x, norm(x)


def _block_deferred(
    block: EncoderBlock, x: torch.Tensor, branch: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, m)`` with ``z + m == block(x + branch)``: the MLP branch ``m`` not yet added."""
    x, h = _add_norm(x, branch, block.norm1, for_linear=True)
    attn_out = block.drop_path(attention_forward(block.attn, h, native_core))
    x, h = _add_norm(x, attn_out, block.norm2, for_linear=True)
    return x, block.drop_path(block.mlp(h))


def _block_cls(block: EncoderBlock, x: torch.Tensor, branch: torch.Tensor | None) -> torch.Tensor:
    """``block(x + branch)[:, :1]``: the CLS token's output alone."""
    x, h = _add_norm(x, branch, block.norm1, for_linear=True)
    cls = x[:, :1] + block.drop_path(attention_forward(block.attn, h, native_core, cls_only=True))
    return cls + block.drop_path(block.mlp(block.norm2(cls)))


def native_vit_forward(net: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """``net(x)`` on the C++ kernels: images (B, C, H, W) -> logits (B, num_classes)."""
    x = embed_forward(net, x)
    branch = None
    for block in net.blocks[:-1]:
        x, branch = _block_deferred(block, x, branch)
    return net.forward_head(net.norm(_block_cls(net.blocks[-1], x, branch)))
