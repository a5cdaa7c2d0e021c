"""How faithful an explanation is: the perturbation test (Chefer, Gur and Wolf 2021a,
"Transformer Interpretability Beyond Attention Visualization", CVPR, section 4).

An explanation scores every patch. Blank the patches one at a time in the order of the
score and watch the accuracy: most relevant first ("positive" perturbation), a faithful
explanation makes the accuracy fall fast, so a lower area under the accuracy curve is
better; least relevant first ("negative"), the accuracy should hold, so a higher area is
better. A random order is the reference both should beat.

Here a blanked patch takes the normalised value of a black background, ``(0 - mean) /
std`` (what the digit's surroundings already are in MNIST), and the curve has a point at
every patch count, ``k = 0, 1, ..., num_patches``, fraction ``k / num_patches`` (exact,
where fixed fractions 0.1, 0.2, ... of 16 patches would have to be rounded).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from einops import repeat
from torch import nn

from vit_mnist.analysis.attention import attention_batches, attention_rollout, cls_attention
from vit_mnist.analysis.modes import evaluating
from vit_mnist.analysis.relevance import class_relevance
from vit_mnist.models.vit import VisionTransformer

DIRECTIONS = ("positive", "negative")


@torch.no_grad()
def explanation_maps(
    model: VisionTransformer, images: torch.Tensor, *, seed: int = 0, batch_size: int = 250
) -> dict[str, torch.Tensor]:
    """The patch scores of each explanation method compared by :func:`perturbation_test`.

    - ``attention``: the last layer's CLS attention over the patches, mean over heads;
    - ``rollout``: attention rollout (Abnar and Zuidema 2020), CLS row;
    - ``relevance``: class relevance for the predicted class (Chefer et al. 2021,
      :func:`~vit_mnist.analysis.relevance.class_relevance`);
    - ``random``: uniform random scores from a generator seeded with ``seed``, the same
      maps for the same seed.

    The model runs in eval mode (restored afterwards) on its parameters' device.

    Args:
        images: (N, C, H, W) float, normalised as the model was trained.

    Returns:
        method -> (N, grid, grid) float32 on the CPU.
    """
    grid = model.patch_embed.grid_size
    attention, rollout = [], []
    for _, weights in attention_batches(model, images, batch_size):
        weights = [w.float() for w in weights]
        attention.append(cls_attention(weights[-1].mean(dim=1), grid).cpu())
        rollout.append(cls_attention(attention_rollout(weights), grid).cpu())
    relevance, _ = class_relevance(model, images, batch_size=batch_size)
    generator = torch.Generator().manual_seed(seed)
    return {
        "attention": torch.cat(attention),
        "rollout": torch.cat(rollout),
        "relevance": relevance,
        "random": torch.rand(len(images), grid, grid, generator=generator),
    }


def blank_patches(
    images: torch.Tensor, order: torch.Tensor, count: int, *, fill: float
) -> torch.Tensor:
    """``images`` with the first ``count`` patches of each image's ``order`` set to ``fill``.

    Args:
        images: (N, C, H, W) float.
        order: (N, P) int64 patch indices, row-major on a (g, g) grid with ``P = g * g``
            and ``H = W = g * patch_size``.
        count: patches to blank per image, 0 .. P.
        fill: the value blanked pixels take (the normalised background).

    Returns:
        (N, C, H, W), a new tensor of ``images``' dtype and device.
    """
    n, p = order.shape
    g = round(p**0.5)
    patch = images.shape[-1] // g
    mask = torch.zeros(n, p, dtype=torch.bool, device=images.device)
    mask.scatter_(1, order[:, :count].to(images.device), True)
    pixels = repeat(mask, "n (gh gw) -> n 1 (gh p) (gw q)", gh=g, p=patch, q=patch)
    return images.masked_fill(pixels, fill)


@dataclass
class PerturbationResult:
    """Accuracy curves of the perturbation test.

    Attributes:
        fractions: (K,) float32, fraction of patches blanked, ``k / num_patches``.
        accuracy: ``accuracy[method][direction]`` is a (K,) float32 tensor of accuracies
            (fractions in [0, 1]) against the original labels; direction is
            ``"positive"`` (most relevant blanked first) or ``"negative"``.
        num_images: images tested.
    """

    fractions: torch.Tensor
    accuracy: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    num_images: int = 0

    def auc(self, method: str, direction: str) -> float:
        """Area under the accuracy-vs-fraction curve, trapezoid rule, in [0, 1]."""
        return float(torch.trapezoid(self.accuracy[method][direction], self.fractions))

    def rows(self) -> list[dict[str, Any]]:
        """One row per method: ``method``, ``positive_auc`` (lower is better),
        ``negative_auc`` (higher is better)."""
        return [
            {
                "method": m,
                "positive_auc": round(self.auc(m, "positive"), 6),
                "negative_auc": round(self.auc(m, "negative"), 6),
            }
            for m in self.accuracy
        ]


def perturbation_passes(scores: Mapping[str, torch.Tensor]) -> int:
    """How many accuracies :func:`perturbation_test` measures for ``scores``: k = 0 and
    k = P once, and k = 1 .. P - 1 per method and direction."""
    patches = next(iter(scores.values()))[0].numel()
    return 2 + len(scores) * len(DIRECTIONS) * (patches - 1)


@torch.no_grad()
def perturbation_test(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    scores: Mapping[str, torch.Tensor],
    *,
    fill: float,
    batch_size: int = 500,
    progress: Callable[[], None] = lambda: None,
) -> PerturbationResult:
    """Accuracy as patches are blanked in the order of each method's scores.

    For every method and direction, at every patch count k = 0 .. P, the k highest-scoring
    patches (positive) or lowest-scoring (negative) of each image are set to ``fill`` and
    the accuracy against ``labels`` is measured. Ties keep the patches' row-major order
    (a stable sort), in both directions. k = 0 (the images as given) and k = P (all
    blank) are the same for every method and computed once.

    The model runs in eval mode (restored afterwards), autocast off, on its parameters'
    device and in their dtype; ``model(x)`` must return logits (B, num_classes).

    Args:
        model: any classifier of the images, e.g. a :class:`VisionTransformer`.
        images: (N, C, H, W) float, normalised as the model was trained.
        labels: (N,) int64 true classes.
        scores: method name -> (N, g, g) patch scores (higher = more relevant), with
            ``H = W = g * patch_size``.
        fill: the normalised value of a black pixel, ``(0 - mean) / std``.
        batch_size: images per forward pass (memory, not results).
        progress: called once per accuracy measured (a pass over the images):
            ``2 + methods * 2 * (P - 1)`` calls (:func:`perturbation_passes`).

    Returns:
        A :class:`PerturbationResult` with fractions ``k / P``.

    Raises:
        ValueError: ``scores`` is empty, or the maps' shapes differ or do not fit the
            images.
    """
    if not scores:
        raise ValueError("perturbation_test needs at least one method's scores")
    n, _, h, w = images.shape
    grid = next(iter(scores.values())).shape[-1]
    for name, s in scores.items():
        if s.shape != (n, grid, grid) or h != w or h % grid:
            raise ValueError(
                f"scores[{name!r}] has shape {tuple(s.shape)} for images of shape "
                f"{tuple(images.shape)}; every method needs ({n}, g, g), one g for all, "
                f"with g dividing the (square) image's side"
            )
    p = grid * grid
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else images.device
    dtype = parameter.dtype if parameter is not None else torch.float32
    labels = labels.to(device)

    def accuracy(order: torch.Tensor, count: int) -> float:
        correct = 0
        for start in range(0, n, batch_size):
            x = images[start : start + batch_size].to(device, dtype)
            x = blank_patches(x, order[start : start + batch_size], count, fill=fill)
            logits = model(x)
            correct += int((logits.argmax(dim=1) == labels[start : start + batch_size]).sum())
        progress()
        return correct / n

    fractions = torch.arange(p + 1, dtype=torch.float32) / p
    result = PerturbationResult(fractions=fractions, num_images=n)
    with evaluating(model), torch.autocast(device.type, enabled=False):
        identity = torch.arange(p).expand(n, p)
        first, last = accuracy(identity, 0), accuracy(identity, p)
        for name, s in scores.items():
            flat = s.flatten(1).float()
            result.accuracy[name] = {}
            for direction in DIRECTIONS:
                order = torch.argsort(flat, dim=1, descending=direction == "positive", stable=True)
                curve = [first] + [accuracy(order, k) for k in range(1, p)] + [last]
                result.accuracy[name][direction] = torch.tensor(curve, dtype=torch.float32)
    return result


def faithfulness_figure(result: PerturbationResult, title: str = ""):
    """Two panels of accuracy vs. fraction of patches blanked: positive and negative
    perturbation, one line per method, its AUC in the legend. A matplotlib figure."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.5, 3.8), dpi=110)
    axes = fig.subplots(1, 2, sharey=True)
    labels = {
        "positive": "positive: most relevant blanked first (lower AUC is better)",
        "negative": "negative: least relevant blanked first (higher AUC is better)",
    }
    for ax, direction in zip(axes, DIRECTIONS, strict=True):
        for method, curves in result.accuracy.items():
            auc = result.auc(method, direction)
            style = {"linestyle": "--", "color": "grey"} if method == "random" else {}
            x, y = result.fractions.numpy(), 100 * curves[direction].numpy()
            ax.plot(x, y, marker=".", label=f"{method} (AUC {auc:.3f})", **style)
        ax.set_title(labels[direction], fontsize=8)
        ax.set_xlabel("fraction of patches blanked")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("accuracy (%)")
    fig.suptitle(title or f"perturbation test on {result.num_images} images", fontsize=9)
    fig.tight_layout()
    return fig
