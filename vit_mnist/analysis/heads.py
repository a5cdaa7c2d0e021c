"""Which heads matter: a head's contribution removed exactly, the accuracy lost without
each head, the gradient head importance (Michel, Levy and Neubig 2019, "Are Sixteen Heads
Really Better than One?", eq. 1 and 2), and its picture."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from vit_mnist.analysis.components import head_counts, head_mask
from vit_mnist.analysis.modes import evaluating
from vit_mnist.analysis.per_class import accuracy_and_loss, predict
from vit_mnist.models.vit import VisionTransformer

T = TypeVar("T")


@contextmanager
def heads_gated(model: VisionTransformer, gate: torch.Tensor) -> Iterator[None]:
    """Inside the block, each head's output is multiplied by its gate xi_h (Michel, Levy and
    Neubig 2019, eq. 1: ``MHAtt(x) = sum_h xi_h Att_h(x)``): head h's slice of the
    concatenated heads before ``W^O`` (``attn.proj``), by forward pre-hooks, so the
    attention code is untouched and any ``attention_impl`` works. A gate of 0 removes the
    head's contribution exactly; gradients flow to ``gate``.

    Args:
        gate: (depth, max heads of a block) float, on any device (read at each forward
            pass, so the model may move inside the block).
    """
    handles = []
    for layer, block in enumerate(model.blocks):
        d, h = block.attn.head_dim, block.attn.num_heads

        def gated(module, inputs, layer=layer, d=d, h=h):
            # (B, T, heads * d_k) * (heads * d_k,): head h's slice times xi_h.
            return (inputs[0] * gate[layer, :h].repeat_interleave(d).to(inputs[0]),)

        handles.append(block.attn.proj.register_forward_pre_hook(gated))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def heads_zeroed(model: VisionTransformer, layer: int, heads: Sequence[int]):
    """Inside the block, the given heads of ``layer`` output zeros: :func:`heads_gated`
    with those heads' gates xi_h = 0, which removes their contribution exactly (Michel,
    Levy and Neubig 2019, eq. 1)."""
    return heads_gated(model, head_mask(model, [(layer, head) for head in heads]))


def heads_switched_off(model: VisionTransformer, heads: Iterable[tuple[int, int]]):
    """Inside the block, every ``(layer, head)`` of ``heads`` outputs zeros: the head mask
    of ``eval.py analysis=heads`` (:func:`heads_zeroed`), for any heads of any layers at
    once. Heads are numbered within their block, as in ``model`` (a pruned model's block
    numbers its remaining heads 0, 1, ...).

    Raises:
        ValueError: a (layer, head) that ``model`` does not have.
    """
    return heads_gated(model, head_mask(model, heads))


def _gate_gradients(
    model: VisionTransformer,
    gate: torch.Tensor,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    progress: Callable[[], None],
) -> tuple[torch.Tensor, int]:
    """``sum_b n_b |dL_b/d gate|`` (float64, the shape of ``gate``) over ``batches`` and the
    number of images, with the heads gated by ``gate`` (on the model's device, in its
    dtype), in eval mode and without autocast, for :func:`gradient_head_importance`;
    ``progress()`` after each batch."""
    total = torch.zeros(gate.shape, dtype=torch.float64, device=gate.device)
    count = 0
    with (
        heads_gated(model, gate),
        evaluating(model),
        torch.enable_grad(),
        torch.autocast(gate.device.type, enabled=False),
    ):
        for images, labels in batches:
            x = images.to(gate.device, gate.dtype)
            y = labels.to(gate.device)
            loss = F.cross_entropy(model(x).float(), y)  # the batch's mean loss L_b
            (grad,) = torch.autograd.grad(loss, gate)
            total += grad.abs().double() * len(y)
            count += len(y)
            progress()
    return total, count


def gradient_head_importance(
    model: VisionTransformer,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    device: torch.device | str | None = None,
    mask: torch.Tensor | None = None,
    progress: Callable[[], None] = lambda: None,
) -> torch.Tensor:
    """Gradient head importance (Michel, Levy and Neubig 2019, eq. 2).

    Each head's output is multiplied by a gate xi_h = 1 (eq. 1, :func:`heads_gated`: the
    model is unchanged), and the importance is the expected absolute gradient of the loss
    with respect to the gate, ``I_h = E_x |dL(x)/d xi_h|`` (eq. 2). Since xi_h = 1,
    ``dL/d xi_h`` is the first-order (Taylor) estimate of the loss change when the head is
    removed, with the sign dropped.

    The expectation is taken per batch, not per example: one backward pass per batch gives
    ``|dL_b/d xi|`` for the batch's mean cross-entropy ``L_b``, and the batches are
    averaged weighted by their sizes, ``I = sum_b (n_b / N) |dL_b/d xi|``. By the
    triangle inequality this is at most the per-example mean of eq. 2 (gradients of
    opposite signs cancel within a batch) and it depends on the batch size; with batches
    of one image it is eq. 2 exactly. No normalisation per layer (the paper's pruning
    experiments divide by each layer's l2 norm; we keep the raw values so layers compare).

    The model runs in eval mode with autocast off, in its parameters' dtype (float32 for a
    trained model); its mode, and its device when
    ``device`` moves it, are restored afterwards. Gradients are taken with
    :func:`torch.autograd.grad` for the gates only: no parameter's ``.grad`` is touched.
    Works whatever ``attention_impl`` the model was built with (the gate acts after the
    attention, before ``W^O``).

    Args:
        model: a :class:`VisionTransformer`.
        batches: an iterable of (images (B, C, H, W) float, labels (B,) int64), e.g. a
            test DataLoader; tensors on any device.
        device: where to compute; default the device of the model's parameters.
        mask: (depth, heads) gate values xi, default all ones; 0 removes a head, so the
            importance is taken in the model with those heads pruned, as in the iterative
            pruning of Michel et al. 2019, section 4 (a removed head's own entry is then
            the gradient of putting it back).
        progress: called once per batch.

    Returns:
        (depth, heads) float32 on the CPU, >= 0, in units of loss (nats) per unit of gate;
        ``heads`` is the largest head count of a block (a block with fewer heads, as in a
        pruned model, has zeros in the columns it lacks).

    Raises:
        ValueError: ``batches`` yields no images, or ``mask`` has the wrong shape.
        RuntimeError: called inside :func:`torch.inference_mode`.
    """
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "gradient_head_importance needs gradients; call it outside torch.inference_mode"
        )
    home, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    device = torch.device(device) if device is not None else home
    shape = (model.depth, max(head_counts(model)))
    if mask is not None and tuple(mask.shape) != shape:
        raise ValueError(f"mask of shape {tuple(mask.shape)}; this model needs {shape}")
    model.to(device)
    gate = torch.ones(shape) if mask is None else mask.detach().clone()
    gate = gate.to(device, dtype).requires_grad_(True)
    try:
        total, count = _gate_gradients(model, gate, batches, progress)
    finally:
        model.to(home)
    if count == 0:
        raise ValueError("gradient_head_importance got no images: the batches are empty")
    return (total / count).float().cpu()


def each_head_zeroed(
    model: VisionTransformer, score: Callable[[], T]
) -> Iterator[tuple[int, int, T]]:
    """``(layer, head, score())`` with each head of ``model`` zeroed in turn
    (:func:`heads_zeroed`), layer by layer; the head is back on when a tuple is yielded."""
    for layer, block in enumerate(model.blocks):
        for head in range(block.attn.num_heads):
            with heads_zeroed(model, layer, [head]):
                result = score()
            yield layer, head, result


def head_importance(
    trainer: L.Trainer,
    module: L.LightningModule,
    loader: DataLoader,
    *,
    progress: Callable[[], None] = lambda: None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Test accuracy and loss with each head's output zeroed in turn (Michel et al. 2019).

    Args:
        progress: called once per pass over ``loader``: the baseline's, then each head's
            (heads + 1 calls).

    Returns:
        The baseline (``acc``, ``loss``) and one row per (layer, head) with ``acc``,
        ``loss``, ``acc_drop`` (baseline acc minus acc, in accuracy points, fractions) and
        ``loss_increase``.
    """
    model: VisionTransformer = module.net

    def score() -> tuple[float, float]:
        result = accuracy_and_loss(trainer, module, loader)
        progress()
        return result

    base_acc, base_loss = score()
    rows = [
        {
            "layer": layer,
            "head": head,
            "acc": round(acc, 6),
            "loss": round(loss, 6),
            "acc_drop": round(base_acc - acc, 6),
            "loss_increase": round(loss - base_loss, 6),
        }
        for layer, head, (acc, loss) in each_head_zeroed(model, score)
    ]
    return {"acc": base_acc, "loss": base_loss}, rows


def class_head_importance(
    trainer: L.Trainer,
    module: L.LightningModule,
    loader: DataLoader,
    class_names: Sequence[str],
    *,
    progress: Callable[[], None] = lambda: None,
) -> list[dict[str, Any]]:
    """Which digits each head matters for: the accuracy lost on each class when the head's
    output is zeroed (the ablation of Michel et al. 2019, :func:`heads_zeroed`, split by
    the true class, as Voita et al. 2019 read heads' roles from what removing them breaks).

    One pass over ``loader`` per head, with ``trainer`` (its device and precision), after
    the baseline's; ``progress`` is called once per pass (heads + 1 calls).

    Returns:
        One row per (layer, head): ``layer``, ``head``, ``acc_drop`` (over all images) and
        ``acc_drop_<name>`` per class (baseline accuracy on that class's images minus the
        accuracy without the head, fractions; 0 for a class with no images), and
        ``most_hurt_class``, the name of the class with the largest drop.
    """
    model: VisionTransformer = module.net
    num_classes = len(class_names)

    def accuracies() -> tuple[float, torch.Tensor]:
        logits, labels = predict(trainer, module, loader)
        right = (logits.argmax(1) == labels).double()
        count = torch.bincount(labels, minlength=num_classes).double()
        right_per_class = torch.bincount(labels, weights=right, minlength=num_classes)
        progress()
        return float(right.mean()), right_per_class / count.clamp_min(1)

    base, base_per_class = accuracies()
    rows = []
    for layer, head, (acc, per_class) in each_head_zeroed(model, accuracies):
        drops = base_per_class - per_class
        row = {"layer": layer, "head": head, "acc_drop": round(base - acc, 6)}
        for name, drop in zip(class_names, drops.tolist(), strict=True):
            row[f"acc_drop_{name}"] = round(drop, 6)
        row["most_hurt_class"] = class_names[int(drops.argmax())]
        rows.append(row)
    return rows


def head_importance_figure(rows: Sequence[dict[str, Any]], depth: int, heads: int, title: str):
    """Layers-by-heads heatmap of the accuracy drop (points) when a head is zeroed."""
    from matplotlib.figure import Figure

    drop = torch.zeros(depth, heads)
    for r in rows:
        drop[r["layer"], r["head"]] = 100 * r["acc_drop"]
    fig = Figure(figsize=(1.5 + 0.9 * heads, 1.0 + 0.55 * depth), dpi=110)
    ax = fig.subplots()
    im = ax.imshow(drop.numpy(), cmap="Reds", vmin=min(0.0, float(drop.min())))
    for layer, h in itertools.product(range(depth), range(heads)):
        ax.text(h, layer, f"{drop[layer, h]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(heads), [f"head {h}" for h in range(heads)])
    ax.set_yticks(range(depth), [f"layer {layer}" for layer in range(depth)])
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="test accuracy drop (points)")
    fig.tight_layout()
    return fig
