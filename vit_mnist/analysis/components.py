"""The residual stream written as the sum it is: the embedding, each head's output, each
MLP's output and the biases, as the model's own modules compute them.

A pre-norm block adds to the residual stream (ViT eq. 2 and 3):

    z'_l = z_{l-1} + sum_i head_i(LN(z_{l-1})) W^O_i + b^O                (eq. 2)
    z_l  = z'_l + MLP(LN(z'_l))                                          (eq. 3)

where ``W^O_i`` is head i's slice of the output projection (the rows of ``W^O`` that
multiply head i in ``Concat(head_1, ..., head_h) W^O``; Elhage et al. 2021, "A
Mathematical Framework for Transformer Circuits", section "Attention Heads are Independent
and Additive"). :func:`run_components` runs a :class:`VisionTransformer` block by block
through its own ``norm1``, ``qkv``, explicit attention, ``proj`` weights, ``norm2`` and
``mlp`` and keeps every term; :func:`resume` continues a forward pass from a residual
stream, which is what activation patching needs. Neither changes the model: a head mask is
an argument (as Michel et al. 2019's gates xi_h, eq. 1), not a hook.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch
from einops import rearrange

from vit_mnist.analysis.modes import evaluating
from vit_mnist.models.vit import EncoderBlock, VisionTransformer


@dataclass
class Components:
    """One forward pass of a batch, every term of the residual stream kept.

    Shapes (B images, T tokens, D = embed_dim, h_l = heads of block l, K classes), float32:

    Attributes:
        embed: (B, T, D) z_0: prefix tokens and patch embeddings plus ``pos_embed``.
        resid_pre: per block, (B, T, D) its input z_{l-1} (``resid_pre[0]`` is ``embed``).
        heads: per block, (B, h_l, T, D): head i's output times its slice of W^O, without
            the bias (zero for a head switched off by the mask).
        attn_bias: per block, (D,) the bias b^O of W^O.
        resid_mid: per block, (B, T, D) z'_l, after the attention's residual line.
        mlp: per block, (B, T, D) the MLP's output (its biases included).
        resid_post: per block, (B, T, D) z_l, the block's output.
        weights: per block, (B, h_l, T, T) the attention weights, rows summing to 1.
        logits: (B, K) the model's prediction from ``resid_post[-1]`` (for a distilled
            model, the two heads' softmax averaged, as its forward does).
    """

    embed: torch.Tensor
    resid_pre: list[torch.Tensor]
    heads: list[torch.Tensor]
    attn_bias: list[torch.Tensor]
    resid_mid: list[torch.Tensor]
    mlp: list[torch.Tensor]
    resid_post: list[torch.Tensor]
    weights: list[torch.Tensor]
    logits: torch.Tensor


def head_outputs(
    block: EncoderBlock, x: torch.Tensor, gate: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's output through its slice of W^O, and the attention weights.

    Args:
        block: an encoder block (its ``norm1`` and ``attn`` are used, explicit path).
        x: (B, T, D) the block's input z_{l-1}.
        gate: (h,) multipliers of the heads' outputs (1 on, 0 off), one row per image
            (B, h), or None.

    Returns:
        (B, h, T, D) ``head_i W^O_i`` (their sum plus ``attn.proj.bias`` is the attention
        branch of eq. 2), and the weights (B, h, T, T).
    """
    attn = block.attn
    qkv = attn.qkv(block.norm1(x))
    q, k, v = rearrange(qkv, "b t (three h d) -> three b h t d", three=3, h=attn.num_heads)
    heads, weights = attn.attention(q, k, v, need_weights=True)  # (B, h, T, d_k)
    w_o = rearrange(attn.proj.weight, "e (h d) -> h d e", h=attn.num_heads)  # W^O_i: (d_k, D)
    out = torch.einsum("bhtd,hde->bhte", heads, w_o)
    if gate is not None:
        out = out * gate.to(out)[..., None, None]
    return out, weights


def head_counts(model: VisionTransformer) -> list[int]:
    """Heads per block of ``model`` (a pruned block has fewer)."""
    return [block.attn.num_heads for block in model.blocks]


def check_heads(
    model: VisionTransformer, heads: Iterable[tuple[int, int]]
) -> list[tuple[int, int]]:
    """``heads``, (layer, head) pairs with heads numbered within their block, as a list.

    Raises:
        ValueError: a (layer, head) that ``model`` does not have.
    """
    counts, heads = head_counts(model), list(heads)
    for layer, head in heads:
        if not (0 <= layer < len(counts) and 0 <= head < counts[layer]):
            raise ValueError(f"no head {layer}:{head} in a model with heads {counts}")
    return heads


def head_mask(model: VisionTransformer, heads_off: Iterable[tuple[int, int]]) -> torch.Tensor:
    """The head mask of :func:`run_components` that switches off ``heads_off``: a (depth,
    max heads of a block) float32 tensor of 1s with 0 at each (layer, head) off.

    Raises:
        ValueError: a (layer, head) that ``model`` does not have (heads numbered within
            their block, as in ``model``: a pruned block numbers its heads 0, 1, ...).
    """
    mask = torch.ones(model.depth, max(head_counts(model)))
    for layer, head in check_heads(model, heads_off):
        mask[layer, head] = 0.0
    return mask


def run_components(
    model: VisionTransformer, images: torch.Tensor, *, head_mask: torch.Tensor | None = None
) -> Components:
    """Run ``model`` on ``images`` and keep every term of its residual stream.

    The model's own modules in the order of its forward, attention by the explicit path
    whatever ``attention_impl`` it was built with; call it in eval mode (no dropout) and,
    when no gradient is wanted, under :func:`torch.no_grad`. Nothing of the model is
    changed, so concurrent calls with different masks are independent.

    Args:
        model: a :class:`VisionTransformer` (distilled and pruned ones included).
        images: (B, C, H, W) float as the model takes them, on the model's device.
        head_mask: (depth, max heads of a block) gates, or one such mask per image (B,
            depth, max heads): 1 keeps a head and 0 removes its output exactly (Michel et
            al. 2019, eq. 1); None keeps every head (:func:`head_mask` builds one).

    Returns:
        :class:`Components`; the logits equal ``model(images)`` to float rounding.

    Raises:
        ValueError: ``head_mask`` of another shape.
    """
    shape = (model.depth, max(head_counts(model)))
    if head_mask is not None and (head_mask.ndim not in (2, 3) or head_mask.shape[-2:] != shape):
        raise ValueError(
            f"head_mask of shape {tuple(head_mask.shape)}; this model needs {shape} or "
            f"(batch, *{shape})"
        )
    x = model.embed(images)
    c = Components(x, [], [], [], [], [], [], [], torch.empty(0))
    for layer, block in enumerate(model.blocks):
        gate = None if head_mask is None else head_mask[..., layer, : block.attn.num_heads]
        heads, weights = head_outputs(block, x, gate)
        mid = x + heads.sum(1) + block.attn.proj.bias  # eq. 2
        mlp = block.mlp(block.norm2(mid))
        c.resid_pre.append(x)
        c.heads.append(heads)
        c.attn_bias.append(block.attn.proj.bias)
        c.resid_mid.append(mid)
        c.mlp.append(mlp)
        c.weights.append(weights)
        x = mid + mlp  # eq. 3
        c.resid_post.append(x)
    c.logits = model.forward_head(model.norm(x))
    return c


Read = TypeVar("Read")


@torch.no_grad()
def read_components(
    model: VisionTransformer,
    images: torch.Tensor,
    read: Callable[[Components], Read],
    batch_size: int,
) -> list[Read]:
    """``read(run_components(model, x))`` for each batch ``x`` of ``images`` (N, C, H, W,
    any device), ``batch_size`` images at a time (memory, not results): the model in eval
    mode, in float32 with autocast off, on its parameters' device; its mode restored."""
    parameter = next(model.parameters())
    with evaluating(model), torch.autocast(parameter.device.type, enabled=False):
        return [
            read(run_components(model, images[i : i + batch_size].to(parameter)))
            for i in range(0, len(images), batch_size)
        ]


def resume(
    model: VisionTransformer, resid: torch.Tensor, layer: int, *, after_attention: bool = False
) -> torch.Tensor:
    """Logits from a residual stream part-way through the model.

    Args:
        resid: (B, T, D) the residual stream before block ``layer`` (``z_{layer-1}``), or
            with ``after_attention`` after its attention branch (``z'_layer``).
        layer: 0 .. depth; ``depth`` (with ``after_attention`` False) reads ``resid`` as
            the last block's output.

    Returns:
        (B, num_classes) logits, as :meth:`VisionTransformer.forward_head` gives them.
    """
    x = resid
    if after_attention:
        block = model.blocks[layer]
        x = x + block.mlp(block.norm2(x))
        layer += 1
    for block in model.blocks[layer:]:
        x = block(x)
    return model.forward_head(model.norm(x))


def head_grid(model: VisionTransformer, values: torch.Tensor) -> torch.Tensor:
    """Per-head values laid out as (depth, max heads), NaN where a block has fewer heads.

    Args:
        values: (..., total heads) in the order layer 0 head 0, layer 0 head 1, ...

    Returns:
        (..., depth, max heads) float32.
    """
    counts = head_counts(model)
    grid = torch.full((*values.shape[:-1], len(counts), max(counts)), float("nan"))
    for layer, part in enumerate(values.split(counts, dim=-1)):
        grid[..., layer, : counts[layer]] = part.float().cpu()
    return grid
