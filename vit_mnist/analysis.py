"""Evaluation analyses of a trained model: per-class metrics, errors, head importance."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchmetrics.functional.classification import (
    multiclass_accuracy,
    multiclass_confusion_matrix,
    multiclass_precision,
    multiclass_recall,
)

from vit_mnist.attention_maps import attention_entropy, mean_attention_distance
from vit_mnist.data.sources import atomic_write_bytes
from vit_mnist.drawing import captioned_grid, grey
from vit_mnist.models.vit import VisionTransformer


def predict(
    trainer: L.Trainer, module: L.LightningModule, loader: DataLoader
) -> tuple[torch.Tensor, torch.Tensor]:
    """All logits and labels of ``loader``, with the trainer's device and precision.

    Returns:
        logits (N, num_classes) float32 and labels (N,) int64, on the CPU.
    """
    outputs = trainer.predict(module, dataloaders=loader)
    logits = torch.cat([o[0].cpu() for o in outputs])
    labels = torch.cat([o[1].cpu() for o in outputs])
    return logits, labels


def class_report(
    logits: torch.Tensor, labels: torch.Tensor, class_names: Sequence[str]
) -> tuple[list[dict[str, Any]], torch.Tensor]:
    """Per-class accuracy (= recall), precision and recall, and the confusion matrix.

    Returns:
        One row per class (``class``, ``name``, ``support``, ``accuracy``, ``precision``,
        ``recall``; fractions in [0, 1]) and the (C, C) int64 confusion matrix, rows =
        true class, columns = predicted class.
    """
    c = len(class_names)
    preds = logits.argmax(dim=1)
    kw = {"num_classes": c, "average": None}
    acc = multiclass_accuracy(preds, labels, **kw)
    precision = multiclass_precision(preds, labels, **kw, zero_division=0)
    recall = multiclass_recall(preds, labels, **kw, zero_division=0)
    cm = multiclass_confusion_matrix(preds, labels, num_classes=c)
    rows = [
        {
            "class": i,
            "name": class_names[i],
            "support": int(cm[i].sum()),
            "accuracy": round(float(acc[i]), 6),
            "precision": round(float(precision[i]), 6),
            "recall": round(float(recall[i]), 6),
        }
        for i in range(c)
    ]
    return rows, cm


def write_csv(path: str | Path, rows: Sequence[dict[str, Any]]) -> None:
    """Write dict rows as a CSV file with a header, atomically."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_bytes(Path(path), buffer.getvalue().encode())


def confusion_matrix_figure(cm: torch.Tensor, class_names: Sequence[str], title: str = ""):
    """A matplotlib figure of the confusion matrix with counts in the cells."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = len(class_names)
    fig, ax = plt.subplots(figsize=(1.0 + 0.62 * c, 0.8 + 0.55 * c), dpi=110)
    # Log colour scale: the diagonal is ~100x the off-diagonal cells.
    ax.imshow(torch.log1p(cm.float()).numpy(), cmap="Blues")
    for i in range(c):
        for j in range(c):
            v = int(cm[i, j])
            colour = "white" if i == j else "black"
            ax.text(j, i, str(v), ha="center", va="center", fontsize=7, color=colour)
    ax.set_xticks(range(c), class_names, rotation=45 if max(map(len, class_names)) > 2 else 0)
    ax.set_yticks(range(c), class_names)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(title or f"confusion matrix ({int(cm.sum())} images)")
    fig.tight_layout()
    return fig


def save_figure(fig, path: str | Path) -> None:
    """Save a matplotlib figure as PNG, atomically, and close it."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    atomic_write_bytes(Path(path), buffer.getvalue())


def misclassified_grid(
    images: torch.Tensor,
    logits: torch.Tensor,
    labels: torch.Tensor,
    class_names: Sequence[str],
    *,
    max_tiles: int = 1000,
    cols: int = 20,
) -> tuple[torch.Tensor, int]:
    """A picture of the misclassified images, captioned ``true>predicted confidence%``.

    Args:
        images: (N, 1, H, W) float, the whole evaluated set, in the order of ``logits``.
        logits: (N, C); labels: (N,).
        max_tiles: at most this many tiles (the first errors in dataset order).

    Returns:
        (3, height, width) uint8 picture and the number of tiles in it.
    """
    probs = logits.softmax(dim=1)
    confidence, preds = probs.max(dim=1)
    wrong = torch.nonzero(preds != labels).flatten()
    total = len(wrong)
    wrong = wrong[:max_tiles]
    captions = [
        f"{class_names[labels[i]]}>{class_names[preds[i]]} {100 * confidence[i]:.0f}%"
        for i in wrong.tolist()
    ]
    shown = "" if total == len(wrong) else f", the first {len(wrong)} shown"
    title = f"{total} misclassified of {len(labels)} (true>predicted confidence){shown}"
    if not len(wrong):
        return captioned_grid(torch.ones(0, 3, *images.shape[-2:]), [], cols=cols, title=title), 0
    return captioned_grid(grey(images[wrong]), captions, cols=cols, title=title), len(wrong)


@contextmanager
def heads_zeroed(model: VisionTransformer, layer: int, heads: Sequence[int]):
    """Inside the block, the given heads of ``layer`` output zeros.

    Zeroing head i's slice of the concatenated heads before ``W^O`` removes its
    contribution exactly (Michel, Levy and Neubig 2019, eq. 1 with the head's gate
    xi_h = 0). Done with a forward pre-hook, so the attention code is untouched.
    """
    attn = model.blocks[layer].attn
    d = attn.head_dim

    def zero(module, inputs):
        x = inputs[0].clone()
        for h in heads:
            x[..., h * d : (h + 1) * d] = 0
        return (x,)

    handle = attn.proj.register_forward_pre_hook(zero)
    try:
        yield
    finally:
        handle.remove()


def head_importance(
    trainer: L.Trainer, module: L.LightningModule, loader: DataLoader
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Test accuracy and loss with each head's output zeroed in turn (Michel et al. 2019).

    Returns:
        The baseline (``acc``, ``loss``) and one row per (layer, head) with ``acc``,
        ``loss``, ``acc_drop`` (baseline acc minus acc, in accuracy points, fractions) and
        ``loss_increase``.
    """
    model: VisionTransformer = module.net

    def score() -> tuple[float, float]:
        logits, labels = predict(trainer, module, loader)
        acc = (logits.argmax(1) == labels).float().mean().item()
        return acc, F.cross_entropy(logits, labels).item()

    base_acc, base_loss = score()
    rows = []
    for layer in range(model.depth):
        for head in range(model.num_heads):
            with heads_zeroed(model, layer, [head]):
                acc, loss = score()
            rows.append(
                {
                    "layer": layer,
                    "head": head,
                    "acc": round(acc, 6),
                    "loss": round(loss, 6),
                    "acc_drop": round(base_acc - acc, 6),
                    "loss_increase": round(loss - base_loss, 6),
                }
            )
    return {"acc": base_acc, "loss": base_loss}, rows


@torch.no_grad()
def head_statistics(
    model: VisionTransformer, images: torch.Tensor, batch_size: int = 250
) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy (nats) and mean attention distance (pixels) of every head on ``images``.

    The same statistics the training callback logs, averaged over all ``images``.

    Returns:
        Two (depth, heads) float32 tensors.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    grid, patch = model.patch_embed.grid_size, model.patch_embed.patch_size
    entropy = torch.zeros(model.depth, model.num_heads)
    distance = torch.zeros(model.depth, model.num_heads)
    try:
        for start in range(0, len(images), batch_size):
            chunk = images[start : start + batch_size].to(device)
            _, weights = model.forward_with_attention(chunk)
            share = len(chunk) / len(images)
            for layer, w in enumerate(weights):
                entropy[layer] += share * attention_entropy(w).cpu()
                distance[layer] += (
                    share * mean_attention_distance(w, grid_size=grid, patch_size=patch).cpu()
                )
    finally:
        model.train(was_training)
    return entropy, distance


def head_importance_figure(rows: Sequence[dict[str, Any]], depth: int, heads: int, title: str):
    """Layers-by-heads heatmap of the accuracy drop (points) when a head is zeroed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drop = torch.zeros(depth, heads)
    for r in rows:
        drop[r["layer"], r["head"]] = 100 * r["acc_drop"]
    fig, ax = plt.subplots(figsize=(1.5 + 0.9 * heads, 1.0 + 0.55 * depth), dpi=110)
    im = ax.imshow(drop.numpy(), cmap="Reds", vmin=min(0.0, float(drop.min())))
    for layer in range(depth):
        for h in range(heads):
            ax.text(h, layer, f"{drop[layer, h]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(heads), [f"head {h}" for h in range(heads)])
    ax.set_yticks(range(depth), [f"layer {layer}" for layer in range(depth)])
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="test accuracy drop (points)")
    fig.tight_layout()
    return fig
