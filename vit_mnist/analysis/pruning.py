"""Head pruning: remove the least important heads a step at a time, and cut them out of
the weights (Michel, Levy and Neubig 2019, "Are Sixteen Heads Really Better than One?",
section 4).

A removed head is cut out of the model, not masked: its rows of the Q, K and V
projections (``attn.qkv``) and its input columns of W^O (``attn.proj``) are deleted, so
the pruned model is smaller, computes exactly what the full model computes with the head's
output zeroed (:func:`~vit_mnist.analysis.heads.heads_zeroed`), and is rebuilt from its
arguments like any other: ``num_heads`` becomes one count per block and ``head_dim`` is
stored, since ``embed_dim // num_heads`` no longer gives it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from einops import rearrange

from vit_mnist.analysis.components import check_heads, head_counts
from vit_mnist.analysis.heads import gradient_head_importance
from vit_mnist.models.vit import VisionTransformer
from vit_mnist.settings import PruneSettings, check_arguments

Head = tuple[int, int]  # (layer, head), head numbered as in the unpruned model


def prune_heads(
    model: VisionTransformer, model_args: Mapping[str, Any], removed: Iterable[Head]
) -> tuple[VisionTransformer, dict[str, Any]]:
    """A copy of ``model`` without the ``removed`` heads, and its constructor arguments.

    For each block, the kept heads' slices are gathered from ``qkv.weight`` (3*h*d_k, D)
    and ``qkv.bias`` (3*h*d_k,), laid out as (Q|K|V, head, d_k), and from the columns of
    ``proj.weight`` (D, h*d_k); ``proj.bias`` and every other parameter are copied as they
    are. The copy's output equals ``model``'s with the removed heads zeroed before W^O, to
    float rounding (the same products, fewer zero terms in the sums).

    Args:
        model: the model to prune (not modified); any device and dtype.
        model_args: its constructor arguments (a checkpoint's ``hyper_parameters["model"]``).
        removed: (layer, head) pairs, heads numbered as in ``model``.

    Returns:
        The pruned model (same device, dtype and train/eval mode) and its arguments, with
        ``num_heads`` a list of one count per block and ``head_dim`` set.

    Raises:
        ValueError: a (layer, head) that ``model`` lacks, or every head of a block removed
            (a block needs one head: W^O of zero heads would be an empty matrix).
    """
    removed, counts = set(check_heads(model, removed)), head_counts(model)
    kept = [[h for h in range(n) if (layer, h) not in removed] for layer, n in enumerate(counts)]
    if not all(kept):
        empty = [layer for layer, heads in enumerate(kept) if not heads]
        raise ValueError(f"every head of block(s) {empty} removed; keep at least one per block")
    head_dim = model.blocks[0].attn.head_dim
    args = {**model_args, "num_heads": [len(k) for k in kept], "head_dim": head_dim}
    state = model.state_dict()
    for layer, heads in enumerate(kept):
        prefix = f"blocks.{layer}.attn."
        index = torch.tensor(heads, device=state[prefix + "proj.weight"].device)
        for name in (prefix + "qkv.weight", prefix + "qkv.bias"):
            if name in state:
                qkv = rearrange(
                    state[name], "(three h d) ... -> three h d ...", three=3, d=head_dim
                )
                state[name] = rearrange(qkv[:, index], "three h d ... -> (three h d) ...")
        o = rearrange(state[prefix + "proj.weight"], "e (h d) -> e h d", d=head_dim)
        state[prefix + "proj.weight"] = rearrange(o[:, index], "e h d -> e (h d)")
    weight = next(model.parameters())
    pruned = VisionTransformer(**args).to(weight.device, weight.dtype)
    pruned.load_state_dict(state)  # strict: every shape must match the new arguments
    return pruned.train(model.training), args


def _normalise_by_layer(importance: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each layer's remaining heads' importance divided by its l2 norm (Michel et al.
    2019, section 4.1), so that heads are compared within the scale of their layer."""
    kept = importance * mask
    return kept / kept.norm(dim=1, keepdim=True).clamp_min(1e-12)


def _least_important(importance: torch.Tensor, mask: torch.Tensor, n: int) -> list[Head]:
    """The ``n`` heads of lowest ``importance`` (depth, heads) still in ``mask`` (1: kept),
    lowest first, never a block's last head; ``mask`` is updated to 0 for them."""
    chosen: list[Head] = []
    for flat in importance.flatten().argsort(stable=True).tolist():
        layer, head = divmod(flat, mask.shape[1])
        if len(chosen) == n:
            break
        if mask[layer, head] == 1 and mask[layer].sum() > 1:
            mask[layer, head] = 0
            chosen.append((layer, head))
    return chosen


def prune_iteratively(
    model: VisionTransformer,
    model_args: Mapping[str, Any],
    importance_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    score: Callable[[VisionTransformer, dict[str, Any]], tuple[float, float]],
    *,
    step_fraction: float = 0.1,
    max_fraction: float = 0.75,
    normalise: bool = True,
    device: torch.device | str | None = None,
) -> tuple[list[dict[str, Any]], VisionTransformer, dict[str, Any]]:
    """Remove heads in order of importance, a step at a time, scoring the model after each
    step (Michel et al. 2019, section 4, with the importance recomputed after each step).

    Each step removes ``ceil(step_fraction * all heads)`` heads: those of lowest gradient
    importance (:func:`~vit_mnist.analysis.heads.gradient_head_importance`, eq. 2),
    computed on ``importance_batches`` with the heads removed so far gated to 0, and, with
    ``normalise``, divided by each layer's l2 norm as in the paper. The last head of a
    block is never removed. It stops once ``max_fraction`` of all heads are removed (or
    only one head per block remains). Each step's model is cut down with
    :func:`prune_heads` and scored as such, so the last row is the returned model's score.

    Args:
        model: an unpruned model (uniform heads); not modified.
        model_args: its constructor arguments.
        importance_batches: (images, labels) batches for the importance, e.g. the
            validation set (not the test set, which ``score`` reports on).
        score: (pruned model, its arguments) -> (accuracy in [0, 1], mean loss).
        step_fraction: fraction of all heads removed per step, in (0, 1].
        max_fraction: fraction of all heads to reach, in (0, 1) (each block keeps a head).
        normalise: divide the importance by each layer's l2 norm before ranking.
        device: where to compute the importance (default: the model's device).

    Returns:
        One row per step (``step``, ``heads_removed``, ``fraction_removed``, ``test_acc``,
        ``test_loss``, ``removed``: the heads removed in that step, ``"layer:head"``
        separated by spaces, numbered as in ``model``), the last step's pruned model, and
        its arguments.

    Raises:
        ValueError: a model whose blocks differ in head count; ConfigError (a ValueError)
            a fraction that ``PruneSettings`` (vit_mnist/settings.py) refuses.
    """
    counts = {block.attn.num_heads for block in model.blocks}
    if len(counts) != 1:
        raise ValueError(f"prune_iteratively needs an unpruned model; its heads are {counts}")
    check_arguments(PruneSettings, {"step_fraction": step_fraction, "max_fraction": max_fraction})
    depth, heads = len(model.blocks), counts.pop()
    total = depth * heads
    per_step = math.ceil(step_fraction * total)
    # Rounded up, as the step: "at least max_fraction", but never a block's last head.
    target = min(math.ceil(max_fraction * total - 1e-9), total - depth)
    mask = torch.ones(depth, heads)
    removed: list[Head] = []
    pruned, args = prune_heads(model, model_args, removed)
    rows = []
    step_removed: Sequence[Head] = []
    while True:
        acc, loss = score(pruned, args)
        rows.append(
            {
                "step": len(rows),
                "heads_removed": len(removed),
                "fraction_removed": round(len(removed) / total, 6),
                "test_acc": round(acc, 6),
                "test_loss": round(loss, 6),
                "removed": " ".join(f"{layer}:{head}" for layer, head in step_removed),
            }
        )
        if len(removed) >= target:
            return rows, pruned, args
        importance = gradient_head_importance(model, importance_batches, device=device, mask=mask)
        if normalise:
            importance = _normalise_by_layer(importance, mask)
        step_removed = _least_important(importance, mask, min(per_step, target - len(removed)))
        removed += step_removed
        pruned, args = prune_heads(model, model_args, removed)


def accuracy_at(rows: Sequence[dict[str, Any]], fraction: float) -> float | None:
    """The test accuracy of the first step with at least ``fraction`` of the heads removed;
    None when pruning stopped before that."""
    return next((r["test_acc"] for r in rows if r["fraction_removed"] >= fraction - 1e-9), None)


def pruning_figure(rows: Sequence[dict[str, Any]], title: str):
    """Test accuracy (%) against the fraction of heads pruned (%), one point per step."""
    from matplotlib.figure import Figure

    x = [100 * r["fraction_removed"] for r in rows]
    y = [100 * r["test_acc"] for r in rows]
    fig = Figure(figsize=(5.5, 3.6), dpi=110)
    ax = fig.subplots()
    ax.plot(x, y, marker="o")
    ax.axhline(y[0], color="grey", linestyle="--", linewidth=0.8, label="unpruned")
    for xy in zip(x, y, strict=True):
        ax.annotate(
            f"{xy[1]:.2f}", xy, textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7
        )
    ax.set(xlabel="heads pruned (% of all heads)", ylabel="test accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
