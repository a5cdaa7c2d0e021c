"""The reference ViT's forward pass on the C++ kernels of :mod:`vit_mnist.speed.native`.

The same arithmetic as ``VisionTransformer.forward`` (to float32 rounding, see
tests/test_speed.py), on the model's own modules, rearranged so that both kernels apply:

- attention: softmax(Q K^T / sqrt(d_k)) V and its backward for all heads of an image in
  one kernel call, reading Q, K and V straight from the packed ``qkv`` projection;
- every residual add and the LayerNorm that reads its sum run as one pass each way. For
  that, a block hands its MLP branch to the next block un-added (:func:`_block_deferred`),
  where ``x + branch`` meets ``norm1``; the last one meets the final ``norm``;
- the last block runs for the CLS token alone (only it reaches the head, ViT eq. 4);
- the patch embedding is a matrix product, as in :func:`~vit_mnist.speed.forward.vit_forward`.

Where a kernel cannot take an input (a shape it was not built for, attention dropout in
training, tracing), that step runs on PyTorch's operations, with the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vit_mnist.models.attention import MultiHeadSelfAttention
from vit_mnist.models.vit import EncoderBlock, VisionTransformer
from vit_mnist.speed import native
from vit_mnist.speed.forward import (
    attention_forward,
    embed_forward,
    explicit_core,
    written_backward_applies,
)


def native_core(
    attn: MultiHeadSelfAttention, q_src: torch.Tensor, kv_src: torch.Tensor | None = None
) -> torch.Tensor:
    """An :data:`~vit_mnist.speed.forward.AttentionCore`: the attention kernel where it
    applies, the explicit arithmetic otherwise.

    Shapes: q_src (B, T, 3*D) packed, or (B, T_q, D) with kv_src (B, T_k, 2*D) ->
    (B, T_q, D), heads concatenated.
    """
    heads = attn.num_heads
    if written_backward_applies(attn, q_src, kv_src) and native.usable(q_src, kv_src, heads):
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


def _block_cls(
    block: EncoderBlock, x: torch.Tensor, branch: torch.Tensor | None, queries: int
) -> torch.Tensor:
    """``block(x + branch)[:, :queries]``: the CLS (and distillation) token's output alone."""
    x, h = _add_norm(x, branch, block.norm1, for_linear=True)
    attn_out = attention_forward(block.attn, h, native_core, queries)
    cls = x[:, :queries] + block.drop_path(attn_out)
    return cls + block.drop_path(block.mlp(block.norm2(cls)))


def native_vit_forward(net: VisionTransformer, x: torch.Tensor, heads: bool = False) -> Any:
    """``net(x)`` on the C++ kernels: images (B, C, H, W) -> logits (B, num_classes); with
    ``heads`` the pair ``net.forward_heads`` gives."""
    x = embed_forward(net, x)
    branch = None
    for block in net.blocks[:-1]:
        x, branch = _block_deferred(block, x, branch)
    x = net.norm(_block_cls(net.blocks[-1], x, branch, net.num_prefix_tokens))
    return net.forward_heads(x) if heads else net.forward_head(x)
