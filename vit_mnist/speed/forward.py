"""The reference ViT's forward pass on its own modules (no weight copied), with a choice of
attention core (:data:`AttentionCore`: the model's own arithmetic, PyTorch's fused kernel, or a
hand-written backward). It differs from ``VisionTransformer.forward`` only beyond float
rounding (tests/test_speed.py): the last block runs for the prefix (CLS, distillation)
tokens only, as only they reach the head (ViT eq. 4)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch.autograd.function import once_differentiable

from vit_mnist.models.attention import MultiHeadSelfAttention, causal_mask
from vit_mnist.models.vit import VisionTransformer

# (attention module, q_src, kv_src) -> Concat(head_1..head_h) (B, T_q, h*d_k), for W^O.
# q_src: the packed qkv projection (B, T, 3*h*d_k) with kv_src None, else the queries
# (B, T_q, h*d_k) and kv_src the keys and values (B, T_k, 2*h*d_k). Query i is token i.
AttentionCore = Callable[[MultiHeadSelfAttention, torch.Tensor, torch.Tensor | None], torch.Tensor]


def split_heads(q_src: torch.Tensor, kv_src: torch.Tensor | None, num_heads: int):
    """Q (B, h, T_q, d_k), K and V (B, h, T_k, d_k): views of an :data:`AttentionCore`'s
    inputs."""
    if kv_src is None:
        return rearrange(q_src, "b t (three h d) -> three b h t d", three=3, h=num_heads)
    k, v = rearrange(kv_src, "b t (two h d) -> two b h t d", two=2, h=num_heads)
    return rearrange(q_src, "b t (h d) -> b h t d", h=num_heads), k, v


def reference_core(
    attn: MultiHeadSelfAttention, q_src, kv_src=None, fused: bool | None = None
) -> torch.Tensor:
    """The model's own arithmetic, :meth:`MultiHeadSelfAttention.attention` (``fused`` as
    there)."""
    heads, _ = attn.attention(*split_heads(q_src, kv_src, attn.num_heads), fused=fused)
    return rearrange(heads, "b h t d -> b t (h d)")


def sdpa_core(attn: MultiHeadSelfAttention, q_src, kv_src=None) -> torch.Tensor:
    """The model's attention on PyTorch's fused kernel, whatever the layer's ``impl``."""
    return reference_core(attn, q_src, kv_src, fused=True)


class ExplicitAttention(torch.autograd.Function):
    """softmax(Q K^T * scale) V with the backward written out (P the weights, dO the
    output's gradient; the softmax gradient as in Bridle 1990):

        dV = P^T dO,   dP = dO V^T,   dS = P * (dP - rowsum(dP * P)),
        dQ = scale * dS K,   dK = scale * dS^T Q

    Inputs as an :data:`AttentionCore`'s (one dtype); output (B, T_q, h*d_k). Gradients go
    back packed as the inputs came; Q, K, V and P are saved; the softmax runs in place."""

    @staticmethod
    def forward(ctx, q_src, kv_src, num_heads: int, scale: float, causal: bool):  # noqa: D102
        q, k, v = (t.flatten(0, 1) for t in split_heads(q_src, kv_src, num_heads))  # (B*h, T, d)
        scores = q.new_empty(q.shape[0], q.shape[1], k.shape[1])
        # out= the input itself: PyTorch's CPU baddbmm ran 4 to 6 times slower without it.
        torch.baddbmm(scores, q, k.transpose(1, 2), beta=0, alpha=scale, out=scores)
        if causal:
            scores.masked_fill_(causal_mask(*scores.shape[1:], q.device), float("-inf"))
        if scores.dtype in (torch.bfloat16, torch.float16):  # float32 softmax, rounded back
            weights = torch.softmax(scores.float(), dim=-1).to(scores.dtype)
        else:  # in place: filling a fresh buffer costs more than the softmax itself
            weights = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
        ctx.save_for_backward(q, k, v, weights)
        ctx.scale, ctx.packed = scale, kv_src is None
        return rearrange(torch.bmm(weights, v), "(b h) t d -> b t (h d)", h=num_heads)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # noqa: D102
        q, k, v, weights = ctx.saved_tensors
        bh, t_q, d = q.shape
        b = grad_out.shape[0]
        grad_out = rearrange(grad_out, "b t (h d) -> (b h) t d", d=d).contiguous()
        # What the input packs, side by side: (dQ, dK, dV), or (dK, dV) with dQ apart.
        grads = q.new_empty(3 if ctx.packed else 2, bh, k.shape[1], d)
        grad_k, grad_v = grads[-2], grads[-1]
        grad_q = grads[0] if ctx.packed else q.new_empty(bh, t_q, d)
        torch.bmm(weights.transpose(1, 2), grad_out, out=grad_v)
        grad_weights = torch.bmm(grad_out, v.transpose(1, 2))
        grad_scores = torch.ops.aten._softmax_backward_data.out(  # written over dP
            grad_weights, weights, -1, weights.dtype, grad_input=grad_weights
        )
        torch.baddbmm(grad_q, grad_scores, k, beta=0, alpha=ctx.scale, out=grad_q)
        torch.baddbmm(grad_k, grad_scores.transpose(1, 2), q, beta=0, alpha=ctx.scale, out=grad_k)
        grad_packed = rearrange(grads, "n (b h) t d -> b t (n h d)", b=b)  # the one copy
        if ctx.packed:
            return grad_packed, None, None, None, None
        return rearrange(grad_q, "(b h) t d -> b t (h d)", b=b), grad_packed, None, None, None


def written_backward_applies(attn: MultiHeadSelfAttention, q_src, kv_src) -> bool:
    """Whether a core with its own backward may take these inputs: a backward follows
    (gradients on, an input that needs one, not tracing) and no attention dropout is drawn
    (the written-out backward has none)."""
    return (
        torch.is_grad_enabled()
        and (q_src.requires_grad or (kv_src is not None and kv_src.requires_grad))
        and not torch.jit.is_tracing()
        and not (attn.training and attn.attn_dropout.p > 0)
    )


def handwritten_backward_core(attn: MultiHeadSelfAttention, q_src, kv_src=None) -> torch.Tensor:
    """:class:`ExplicitAttention` where :func:`written_backward_applies`, else
    :func:`reference_core`."""
    if written_backward_applies(attn, q_src, kv_src):
        return ExplicitAttention.apply(q_src, kv_src, attn.num_heads, attn.scale, attn.causal)
    return reference_core(attn, q_src, kv_src)


def attention_forward(
    attn: MultiHeadSelfAttention, x: torch.Tensor, core: AttentionCore, queries: int = 0
) -> torch.Tensor:
    """``attn(x)`` with ``core`` for the softmax step: x (B, T, D) -> (B, T, D); with
    ``queries`` > 0 the first ``queries`` tokens' output alone, (B, queries, D), from the
    rows of ``attn.qkv`` that make their queries and every token's keys and values."""
    if not queries:
        return attn.proj_dropout(attn.proj(core(attn, attn.qkv(x), None)))
    d, weight, bias = attn.num_heads * attn.head_dim, attn.qkv.weight, attn.qkv.bias
    q_src = F.linear(x[:, :queries], weight[:d], None if bias is None else bias[:d])
    kv_src = F.linear(x, weight[d:], None if bias is None else bias[d:])
    return attn.proj_dropout(attn.proj(core(attn, q_src, kv_src)))


def add_norm(x: torch.Tensor, branch: torch.Tensor | None, norm: torch.nn.LayerNorm):
    """``(s, norm(s))`` with ``s = x + branch`` (``x`` where ``branch`` is None): a residual
    add and the LayerNorm that reads its sum; x (B, T, D) float32, branch as x, or bfloat16
    under autocast (the sum stays float32, as in the reference)."""
    x = x if branch is None else x + branch
    return x, norm(x)


def vit_forward(
    net: VisionTransformer,
    x: torch.Tensor,
    core: AttentionCore = reference_core,
    heads: bool = False,
    add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = add_norm,
) -> Any:
    """``net(x)``: images (B, C, H, W) -> logits (B, num_classes), with ``core`` in every
    block, ``add_norm`` (as :func:`add_norm`) for each residual add and the LayerNorm after
    it, and the last block for the prefix tokens only; with ``heads`` the pair
    ``net.forward_heads`` gives (a distillation's loss needs both). A block's MLP branch is
    added where the next block's first LayerNorm reads the sum (ViT eq. 2-3)."""
    x, branch, n = net.embed(x), None, net.num_prefix_tokens
    for i, block in enumerate(net.blocks):
        queries = n if i == len(net.blocks) - 1 else 0
        x, h = add_norm(x, branch, block.norm1)
        attn_out = block.drop_path(attention_forward(block.attn, h, core, queries))
        x, h = add_norm(x[:, :queries] if queries else x, attn_out, block.norm2)
        branch = block.drop_path(block.mlp(h))
    x = net.norm(x + branch)
    return net.forward_heads(x) if heads else net.forward_head(x)
