"""Which heads matter: a head's contribution removed exactly, the accuracy lost without
each head (Michel, Levy and Neubig 2019, "Are Sixteen Heads Really Better than One?"),
and its picture."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from vit_mnist.analysis.per_class import predict
from vit_mnist.models.vit import VisionTransformer


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
