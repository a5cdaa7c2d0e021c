"""What the heads look at: attention maps, rollout, per-head statistics, and their pictures.

Everything here works on the attention weights that
:meth:`vit_mnist.models.vit.VisionTransformer.forward_with_attention` returns: a list with
one tensor per layer, each (batch, heads, tokens, tokens), token 0 being the CLS token and
tokens 1.. the patches in row-major order. :func:`attention_report` runs a model on a batch
and returns the pictures and scalars that the TensorBoard callback logs; it serves any
model and any batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from einops import rearrange

from vit_mnist.analysis.drawing import colorize, labelled_grid, overlay
from vit_mnist.analysis.modes import evaluating
from vit_mnist.analysis.relevance import class_relevance
from vit_mnist.models.vit import VisionTransformer


def attention_rollout(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """Attention rollout through all layers (Abnar and Zuidema 2020, section 3).

    Per layer the heads are averaged, the identity is added for the residual connection
    and the rows are renormalised, ``A_l = norm(mean_h(W_l) + I)``; the rollout is the
    product ``A_L ... A_2 A_1``.

    Args:
        weights: one (batch, heads, tokens, tokens) tensor per layer, rows summing to 1.

    Returns:
        (batch, tokens, tokens) float32; row t says how much each input token flows into
        output token t. Rows sum to 1.

    Raises:
        ValueError: ``weights`` is empty.
    """
    if not weights:
        raise ValueError("attention_rollout needs the weights of at least one layer")
    tokens = weights[0].shape[-1]
    eye = torch.eye(tokens, device=weights[0].device)
    rollout = None
    for w in weights:
        a = w.float().mean(dim=1) + eye  # (B, T, T)
        a = a / a.sum(dim=-1, keepdim=True)
        rollout = a if rollout is None else a @ rollout
    return rollout


def attention_entropy(weights: torch.Tensor) -> torch.Tensor:
    """Entropy of each head's attention distribution, in nats.

    Args:
        weights: (batch, heads, tokens, tokens), rows summing to 1.

    Returns:
        (heads,) float32: ``-sum_k p_qk log p_qk`` averaged over query tokens and images.
        0 means every query looks at one token; ``log(tokens)`` means uniform attention.
    """
    w = weights.float()
    return -torch.special.xlogy(w, w).sum(dim=-1).mean(dim=(0, 2))


@lru_cache(maxsize=16)
def _patch_distances(grid_size: int, patch_size: int) -> torch.Tensor:
    cells = torch.arange(grid_size)
    centres = torch.cartesian_prod(cells, cells).float() * patch_size  # the +p/2 cancels
    return torch.cdist(centres, centres)  # (N, N) pixels


def mean_attention_distance(
    weights: torch.Tensor, *, grid_size: int, patch_size: int
) -> torch.Tensor:
    """Mean attention distance per head, in pixels (Dosovitskiy et al. 2021, Appendix D.7).

    For each patch query, the distance in pixels between its patch centre and every patch
    key's centre, weighted by the attention it pays to that key (renormalised over the
    patch keys, so the CLS token, and a distillation token, do not count), averaged over
    queries and images.

    Args:
        weights: (batch, heads, tokens, tokens): the CLS token (and a distillation token),
            then the ``grid_size**2`` patches.
        grid_size: patches per image side.
        patch_size: patch side in pixels.

    Returns:
        (heads,) float32, in pixels.
    """
    patches = grid_size**2  # the last tokens, after the CLS (and distillation) token
    w = weights[:, :, -patches:, -patches:].float()
    w = w / w.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    dist = _patch_distances(grid_size, patch_size).to(w.device)
    return (w * dist).sum(dim=-1).mean(dim=(0, 2))


def cls_attention(weights: torch.Tensor, grid_size: int, token: int = 0) -> torch.Tensor:
    """The CLS token's attention over the patches, as images; or another query token's.

    Args:
        weights: (batch, heads, tokens, tokens), or (batch, tokens, tokens) for a rollout:
            the CLS token (and a distillation token), then the ``grid_size**2`` patches.
        token: the query token whose row is taken: 0 = CLS, 1 = the distillation token of
            a distilled model, ``prefix + r * grid_size + c`` = the patch in row r, column
            c, with ``prefix`` the model's ``num_prefix_tokens``.

    Returns:
        (batch, heads, grid_size, grid_size), or (batch, grid_size, grid_size).
    """
    patches = weights[..., token, -(grid_size**2) :]
    return rearrange(patches, "... (gh gw) -> ... gh gw", gh=grid_size)


# ----------------------------------------------------------------------------- report


def attention_batches(
    model: VisionTransformer, images: torch.Tensor, batch_size: int
) -> Iterator[tuple[slice, list[torch.Tensor]]]:
    """``(rows, weights)`` for each batch ``images[rows]`` of ``batch_size``: the attention
    weights of :meth:`VisionTransformer.forward_with_attention`, the model in eval mode (its
    mode restored after the last batch) and on its parameters' device."""
    device = next(model.parameters()).device
    with evaluating(model):
        for start in range(0, len(images), batch_size):
            rows = slice(start, start + batch_size)
            yield rows, model.forward_with_attention(images[rows].to(device))[1]


@torch.no_grad()
def head_statistics(
    model: VisionTransformer, images: torch.Tensor, batch_size: int = 250
) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy (nats) and mean attention distance (pixels) of every head on ``images``.

    The same statistics the training callback logs, averaged over all ``images``.

    Returns:
        Two (depth, heads) float32 tensors; ``heads`` is the largest head count of a block
        (a block with fewer heads, as in a pruned model, has zeros in the columns it lacks).
    """
    grid, patch = model.patch_embed.grid_size, model.patch_embed.patch_size
    heads = max(block.attn.num_heads for block in model.blocks)
    entropy = torch.zeros(model.depth, heads)
    distance = torch.zeros(model.depth, heads)
    for _, weights in attention_batches(model, images, batch_size):
        for layer, w in enumerate(weights):
            h, share = w.shape[1], len(w) / len(images)
            entropy[layer, :h] += share * attention_entropy(w).cpu()
            distance[layer, :h] += (
                share * mean_attention_distance(w, grid_size=grid, patch_size=patch).cpu()
            )
    return entropy, distance


@dataclass
class AttentionReport:
    """Pictures and numbers about a model's attention on one batch of images.

    Attributes:
        layer_grids: one (3, H, W) uint8 picture per layer: heads as rows, images as
            columns, the CLS token's attention overlaid on each image.
        matrices: ``matrices[layer][head]`` is the (3, T, T) uint8 token-by-token
            attention matrix of the first image, T = 1 + patches.
        rollout: (3, H, W) uint8 picture: attention rollout overlaid on each image; with
            ``relevance=True`` a second row, the class relevance map of the predicted class.
        entropy: ``entropy[layer]`` is a (heads,) tensor in nats.
        distance: ``distance[layer]`` is a (heads,) tensor of mean attention distance
            in pixels.
        weights: the raw weights, one (batch, heads, T, T) float tensor per layer.
        logits: (batch, num_classes) float32, from the same forward pass.
        relevance: (batch, grid, grid) float32 class relevance maps (Chefer et al. 2021)
            of the predicted classes, or None when not asked for.
    """

    layer_grids: list[torch.Tensor] = field(default_factory=list)
    matrices: list[list[torch.Tensor]] = field(default_factory=list)
    rollout: torch.Tensor | None = None
    entropy: list[torch.Tensor] = field(default_factory=list)
    distance: list[torch.Tensor] = field(default_factory=list)
    weights: list[torch.Tensor] = field(default_factory=list)
    logits: torch.Tensor | None = None
    relevance: torch.Tensor | None = None


@torch.no_grad()
def _column_labels(
    labels: Sequence[int | str] | torch.Tensor | None,
    preds: list[int],
    class_names: Sequence[str] | None,
) -> list[str]:
    """``true>predicted`` per image (the prediction alone without ``labels``), integer
    classes by their names in ``class_names``."""

    def name(v: int | str) -> str:
        v = int(v) if isinstance(v, torch.Tensor) else v
        return class_names[v] if class_names is not None and isinstance(v, int) else str(v)

    given = labels.tolist() if isinstance(labels, torch.Tensor) else labels
    return [
        f"{name(given[i])}>{name(p)}" if given is not None else name(p) for i, p in enumerate(preds)
    ]


def _layer_grid(
    images: torch.Tensor, w: torch.Tensor, grid: int, col_labels: list[str], layer: int, zoom: int
) -> torch.Tensor:
    """One layer's picture: a row per head (and per prefix token: CLS, then a distilled
    model's distillation token) of its attention over each image of ``images``
    (N, C, H, W), from the weights ``w`` (N, heads, tokens, tokens); (3, H', W') uint8."""
    n, heads = images.shape[0], w.shape[1]
    prefix = w.shape[-1] - grid**2
    maps = torch.cat([cls_attention(w, grid, t) for t in range(prefix)], dim=1)
    tiles = rearrange(
        overlay(images.repeat_interleave(prefix * heads, 0), maps.flatten(0, 1)),
        "(n h) c y x -> h n c y x",
        n=n,
    )
    row_labels = [f"{name}head {h}" for name in ("", "dist. ")[:prefix] for h in range(heads)]
    whose = "CLS" if prefix == 1 else "CLS and distillation token"
    title = f"layer {layer}: {whose} attention per head (true>predicted)"
    return labelled_grid(
        tiles, row_labels=row_labels, col_labels=col_labels, title=title, zoom=zoom
    )


def _rollout_grid(
    images: torch.Tensor,
    weights: list[torch.Tensor],
    grid: int,
    relevance: torch.Tensor | None,
    col_labels: list[str],
    zoom: int,
) -> torch.Tensor:
    """The attention rollout of each image, and under it its class relevance when given
    (N, grid, grid); (3, H', W') uint8."""
    rollout_maps = cls_attention(attention_rollout(weights), grid)  # (N, g, g)
    rows, row_labels = [overlay(images, rollout_maps)], ["rollout"]
    title = "attention rollout (Abnar and Zuidema 2020), true>predicted"
    if relevance is not None:
        rows.append(overlay(images, relevance))
        row_labels.append("relevance")
        title = "rollout and relevance of the predicted class (Chefer et al. 2021), true>predicted"
    return labelled_grid(
        torch.stack(rows), row_labels=row_labels, col_labels=col_labels, title=title, zoom=zoom
    )


def attention_report(
    model: VisionTransformer,
    images: torch.Tensor,
    labels: Sequence[int | str] | torch.Tensor | None = None,
    *,
    class_names: Sequence[str] | None = None,
    zoom: int = 3,
    relevance: bool = True,
    pictures: bool = True,
) -> AttentionReport:
    """Run ``model`` on ``images`` through the explicit attention path and draw what it sees.

    The model is put in eval mode for the call (no dropout) and restored afterwards; no
    gradients are kept. Works whatever ``attention_impl`` the model was built with, and
    with causal attention. With ``relevance`` one more forward and backward pass gives the
    class relevance of the predicted classes (:func:`class_relevance`: gradients with
    respect to the attention weights only, no parameter's ``.grad`` is touched).

    Args:
        model: a :class:`VisionTransformer`.
        images: (N, in_chans, H, W) float, as the model takes them.
        labels: N labels shown above the columns (true classes, or any text).
        class_names: names for integer labels (e.g. Fashion-MNIST's).
        zoom: magnification of each 28 x 28 tile in the pictures.
        relevance: also compute the relevance maps and draw them under the rollout.
        pictures: draw ``layer_grids``, ``matrices`` and ``rollout``; False leaves them
            empty (None) and returns the numbers only, for a caller that draws its own.

    Returns:
        An :class:`AttentionReport`.

    Raises:
        RuntimeError: ``relevance`` inside :func:`torch.inference_mode` (no gradients).
    """
    if relevance and torch.is_inference_mode_enabled():
        raise RuntimeError(
            "attention_report(relevance=True) needs gradients; call it outside "
            "torch.inference_mode, or pass relevance=False"
        )
    with evaluating(model):
        logits, weights = model.forward_with_attention(images.to(next(model.parameters()).device))
    weights = [w.float().cpu() for w in weights]
    preds = logits.argmax(dim=-1).cpu().tolist()
    grid, patch = model.patch_embed.grid_size, model.patch_embed.patch_size
    images = images.float().cpu()
    col_labels = _column_labels(labels, preds, class_names)
    report = AttentionReport(weights=weights, logits=logits.float().cpu())
    for layer, w in enumerate(weights):
        report.entropy.append(attention_entropy(w))
        report.distance.append(mean_attention_distance(w, grid_size=grid, patch_size=patch))
        if not pictures:
            continue
        heads = w.shape[1]
        report.layer_grids.append(_layer_grid(images, w, grid, col_labels, layer, zoom))
        report.matrices.append(
            [(colorize(w[0, h][None])[0] * 255).round().to(torch.uint8) for h in range(heads)]
        )
    if relevance:
        # The classes of the forward pass above, so the row explains the label's ">7".
        report.relevance, _ = class_relevance(model, images, logits.argmax(dim=-1).cpu())
    if not pictures:
        return report
    report.rollout = _rollout_grid(images, weights, grid, report.relevance, col_labels, zoom)
    return report
