"""Per-class results of a trained model: predictions, accuracy, precision and recall per
class, the confusion matrix, and pictures of the misclassified images."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
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

from vit_mnist.analysis.drawing import captioned_grid, grey, labelled_grid, overlay
from vit_mnist.analysis.relevance import class_relevance
from vit_mnist.models.vit import VisionTransformer


def predict(
    trainer: L.Trainer, module: L.LightningModule, loader: DataLoader
) -> tuple[torch.Tensor, torch.Tensor]:
    """All logits and labels of ``loader``, with the trainer's device and precision.

    Returns:
        logits (N, num_classes) float32 and labels (N,) int64, on the CPU.
    """
    outputs = trainer.predict(module, dataloaders=loader)
    logits, labels = (torch.cat([o[i].cpu() for o in outputs]) for i in (0, 1))
    return logits, labels


def accuracy_and_loss(
    trainer: L.Trainer, module: L.LightningModule, loader: DataLoader
) -> tuple[float, float]:
    """Accuracy (fraction in [0, 1]) and mean cross-entropy (nats) of ``module`` on
    ``loader``, through :func:`predict`."""
    logits, labels = predict(trainer, module, loader)
    accuracy = (logits.argmax(1) == labels).float().mean().item()
    return accuracy, F.cross_entropy(logits, labels).item()


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


def confusion_matrix_figure(cm: torch.Tensor, class_names: Sequence[str], title: str = ""):
    """A matplotlib figure of the confusion matrix with counts in the cells."""
    from matplotlib.figure import Figure

    c = len(class_names)
    fig = Figure(figsize=(1.0 + 0.62 * c, 0.8 + 0.55 * c), dpi=110)
    ax = fig.subplots()
    # Log colour scale: the diagonal is ~100x the off-diagonal cells.
    ax.imshow(torch.log1p(cm.float()).numpy(), cmap="Blues")
    for i, j in itertools.product(range(c), repeat=2):
        colour = "white" if i == j else "black"
        ax.text(j, i, str(int(cm[i, j])), ha="center", va="center", fontsize=7, color=colour)
    ax.set_xticks(range(c), class_names, rotation=45 if max(map(len, class_names)) > 2 else 0)
    ax.set_yticks(range(c), class_names)
    ax.set(xlabel="predicted class", ylabel="true class")
    ax.set_title(title or f"confusion matrix ({int(cm.sum())} images)")
    fig.tight_layout()
    return fig


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
    confidence, preds = logits.softmax(dim=1).max(dim=1)
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


def misclassified_relevance_grid(
    model: VisionTransformer,
    images: torch.Tensor,
    logits: torch.Tensor,
    labels: torch.Tensor,
    class_names: Sequence[str],
    *,
    max_images: int = 16,
) -> tuple[torch.Tensor | None, int]:
    """What speaks for the true and for the predicted class in the misclassified images.

    Columns: the first ``max_images`` misclassified images in dataset order, labelled
    ``true>predicted``; rows: the input, the class relevance map (Chefer et al. 2021) of
    the true class and that of the predicted class, each overlaid on the image and scaled
    to its own range. Takes two forward and backward passes on those images.

    Args:
        model: the :class:`VisionTransformer` that gave ``logits``.
        images: (N, 1, H, W) float, as the model takes them, in the order of ``logits``.
        logits: (N, C); labels: (N,).

    Returns:
        (3, height, width) uint8 picture and its number of columns; (None, 0) when no
        image is misclassified.
    """
    preds = logits.argmax(dim=1)
    wrong = torch.nonzero(preds != labels).flatten()
    total = len(wrong)
    wrong = wrong[:max_images]
    if not len(wrong):
        return None, 0
    x, true, pred = images[wrong].float(), labels[wrong], preds[wrong]
    for_true, _ = class_relevance(model, x, true)
    for_pred, _ = class_relevance(model, x, pred)
    tiles = torch.stack([grey(x), overlay(x, for_true), overlay(x, for_pred)])
    shown = f"the first {len(wrong)} of {total}" if total > len(wrong) else f"all {total}"
    picture = labelled_grid(
        tiles,
        row_labels=["input", "true class", "predicted"],
        col_labels=[f"{class_names[t]}>{class_names[p]}" for t, p in zip(true, pred, strict=True)],
        title=f"class relevance (Chefer et al. 2021) of the true and the predicted class, "
        f"{shown} misclassified test images (true>predicted)",
    )
    return picture, len(wrong)
