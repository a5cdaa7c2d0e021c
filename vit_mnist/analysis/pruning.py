"""Head pruning: remove the least important heads a step at a time, re-scoring after each
step, and cut them out of the weights (Michel, Levy and Neubig 2019, "Are Sixteen Heads
Really Better than One?", section 4), by each of several measures of a head
(:data:`MEASURES`), so that they can be compared by what removing their choices costs.

A removed head is cut out of the model, not masked: its rows of the Q, K and V
projections (``attn.qkv``) and its input columns of W^O (``attn.proj``) are deleted, so
the pruned model is smaller, computes exactly what the full model computes with the head's
output zeroed (:func:`~vit_mnist.analysis.heads.heads_zeroed`), and is rebuilt from its
arguments like any other: ``num_heads`` becomes one count per block and ``head_dim`` is
stored, since ``embed_dim // num_heads`` no longer gives it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from vit_mnist.analysis.components import check_heads, head_counts, resume, run_components
from vit_mnist.analysis.heads import gradient_head_importance
from vit_mnist.analysis.logit_attribution import direct_logit_attribution, margin_attribution
from vit_mnist.analysis.modes import evaluating
from vit_mnist.analysis.patching import activation_patching
from vit_mnist.hardware import describe_device
from vit_mnist.models import build_model
from vit_mnist.models.vit import VisionTransformer
from vit_mnist.settings import PRUNE_ORDERS

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
    # build_model, not the class: a checkpoint of an earlier version stores keys that are
    # no longer constructor arguments (``compile``), which it knows to leave out.
    pruned = build_model(args).to(weight.device, weight.dtype)
    pruned.load_state_dict(state)  # strict: every shape must match the new arguments
    return pruned.train(model.training), args


@dataclass
class MeasureData:
    """The validation images the measures of a head read.

    Attributes:
        images: (N, C, H, W) float32, normalised as the model takes them.
        labels: (N,) int64 their classes.
        pairs: for ``patching``: (clean class a, corrupted class b, clean images (n, C, H,
            W), corrupted images (n, C, H, W)), as :func:`measure_data` picks them.
        seed: of the ``random`` order.
        normalise: divide the ``gradient`` measure by each layer's l2 norm (Michel et al.
            2019, section 4.1).
        batch_size: images per forward pass (memory, not results).
    """

    images: torch.Tensor
    labels: torch.Tensor
    pairs: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    seed: int = 0
    normalise: bool = True
    batch_size: int = 500

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        sizes = self.images.split(self.batch_size), self.labels.split(self.batch_size)
        return list(zip(*sizes, strict=True))


def _gradient(model: VisionTransformer, data: MeasureData) -> torch.Tensor:
    """|dL/d xi_h| on the validation images (Michel et al. 2019, eq. 2), with ``normalise``
    divided by each layer's l2 norm (section 4.1), so heads compare within their layer."""
    importance = gradient_head_importance(model, data.batches())
    if data.normalise:
        importance = importance / importance.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return importance


@torch.no_grad()
def _ablation(model: VisionTransformer, data: MeasureData) -> torch.Tensor:
    """The validation loss increase (nats) when the head's output is zeroed: the cost of
    removing it alone, which the gradient measure estimates to first order. Each ablated
    run starts from the unablated run's residual stream after the head's attention branch,
    less the head's output (the blocks before it do not change)."""
    counts, device = head_counts(model), next(model.parameters()).device
    loss = torch.zeros(model.depth, max(counts))
    base = 0.0
    with evaluating(model), torch.autocast(device.type, enabled=False):
        for x, y in data.batches():
            c, y = run_components(model, x.to(device)), y.to(device)
            base += F.cross_entropy(c.logits, y, reduction="sum").item()
            for layer, heads in enumerate(c.heads):
                for head in range(counts[layer]):
                    resid = c.resid_mid[layer] - heads[:, head]
                    logits = resume(model, resid, layer, after_attention=True)
                    loss[layer, head] += F.cross_entropy(logits, y, reduction="sum").item()
    grid = (loss - base) / len(data.labels)
    for layer, n in enumerate(counts):
        grid[layer, n:] = float("nan")
    return grid


def _logit_attribution(model: VisionTransformer, data: MeasureData) -> torch.Tensor:
    """The mean size |.| of each head's direct contribution to the margin of the true class
    over the runner-up (logits;
    :func:`~vit_mnist.analysis.logit_attribution.margin_attribution`)."""
    attribution = direct_logit_attribution(model, data.images, batch_size=data.batch_size)
    margin = margin_attribution(attribution, data.labels)[1]  # (N, components)
    return attribution.heads(model, margin.abs().mean(0))


def _patching(model: VisionTransformer, data: MeasureData) -> torch.Tensor:
    """The share of ``logit_a - logit_b`` that patching the head's output from the
    corrupted image destroys (noising, :func:`~vit_mnist.analysis.patching.activation_patching`),
    in size, averaged over the competing class pairs: how necessary it is to those decisions."""
    if not data.pairs:
        raise ValueError("the patching measure needs class pairs with images; none were found")
    scores = [
        activation_patching(
            model, clean, corrupted, a, b, directions=("noising",), kinds=("heads",)
        ).score("noising", "heads")
        for a, b, clean, corrupted in data.pairs
    ]
    return torch.stack(scores).abs().mean(0)


def _random(model: VisionTransformer, data: MeasureData) -> torch.Tensor:
    """Uniform random scores, drawn afresh each step from ``seed`` and the heads left (the
    floor every measure should beat)."""
    generator = torch.Generator().manual_seed(data.seed + sum(head_counts(model)))
    return torch.rand(model.depth, max(head_counts(model)), generator=generator)


#: Each order's measure: (model, data) -> (depth, max heads of a block) float32, higher for
#: a head that matters more; the keys are settings.PRUNE_ORDERS (``prune.orders``).
MEASURES: dict[str, Callable[[VisionTransformer, MeasureData], torch.Tensor]] = {
    "gradient": _gradient,
    "ablation": _ablation,
    "logit_attribution": _logit_attribution,
    "patching": _patching,
    "random": _random,
}
assert tuple(MEASURES) == PRUNE_ORDERS, "settings.PRUNE_ORDERS names the measures"


def competing_pairs(logits: torch.Tensor, labels: torch.Tensor, n: int) -> list[tuple[int, int]]:
    """The ``n`` class pairs that most often come first and second in ``logits`` (N, K)
    for images of ``labels`` (N,): counted by (true class, its strongest rival: the
    prediction of an error, the runner-up of a right answer), either way round, each
    oriented from the class more often rivalled by the other. The errors of a well
    trained model are the rare end of the same counts, and there is always a rival."""
    rival = logits.scatter(1, labels[:, None], float("-inf")).argmax(1)
    k = logits.shape[1]
    counts = torch.zeros(k, k, dtype=torch.long)
    counts.index_put_((labels, rival), torch.ones_like(labels), accumulate=True)
    both = (counts + counts.T).triu(1)
    order = both.flatten().argsort(descending=True, stable=True)[:n].tolist()
    pairs = [divmod(i, k) for i in order if both.flatten()[i] > 0]
    return [(a, b) if counts[a, b] >= counts[b, a] else (b, a) for a, b in pairs]


def measure_data(
    images: torch.Tensor,
    labels: torch.Tensor,
    logits: torch.Tensor,
    *,
    num_images: int,
    seed: int = 0,
    normalise: bool = True,
    pairs: int = 3,
    pair_images: int = 50,
) -> MeasureData:
    """The :class:`MeasureData` of validation ``images`` (N, C, H, W), their ``labels``
    (N,) and the unpruned model's ``logits`` (N, K): the first ``num_images`` images, and
    for the patching measure the ``pairs`` most competing class pairs
    (:func:`competing_pairs`) with up to ``pair_images`` images of each class, those the
    model classifies right first (as analysis=circuits patches: 3 pairs of 50)."""
    wrong = (logits.argmax(1) != labels).long()

    def of_class(c: int) -> torch.Tensor:
        index = torch.nonzero(labels == c)[:, 0]
        return images[index[wrong[index].argsort(stable=True)]][:pair_images]

    chosen = []
    for a, b in competing_pairs(logits, labels, pairs):
        clean, corrupted = of_class(a), of_class(b)
        n = min(len(clean), len(corrupted))
        if n:
            chosen.append((a, b, clean[:n], corrupted[:n]))
    return MeasureData(images[:num_images], labels[:num_images], chosen, seed, normalise)


@dataclass
class Step:
    """One step of an order: the heads removed so far (numbered as in the unpruned model),
    those this step removed, and the pruned model's validation (and later test) scores."""

    order: str
    removed: list[Head]
    step_removed: list[Head]
    val_acc: float
    val_loss: float
    test_acc: float | None = None
    test_loss: float | None = None

    def row(self, total: int) -> dict[str, Any]:
        """The ``pruning.csv`` row; accuracies are fractions, losses nats."""
        return {
            "order": self.order,
            "heads_removed": len(self.removed),
            "heads_kept": total - len(self.removed),
            "fraction_removed": round(len(self.removed) / total, 6),
            "val_acc": round(self.val_acc, 6),
            "val_loss": round(self.val_loss, 6),
            "test_acc": "" if self.test_acc is None else round(self.test_acc, 6),
            "test_loss": "" if self.test_loss is None else round(self.test_loss, 6),
            "removed": " ".join(f"{layer}:{head}" for layer, head in self.step_removed),
        }


def _least_important(values: torch.Tensor, kept: list[list[int]], n: int) -> list[Head]:
    """The ``n`` heads of lowest ``values`` (depth, max heads; pruned numbering, a block's
    heads ``kept[layer]`` in the unpruned one), lowest first, never a block's last head;
    numbered as in the unpruned model. ``kept`` is updated."""
    chosen: list[Head] = []
    flat = [
        (float(values[layer, j]), layer, j) for layer, k in enumerate(kept) for j in range(len(k))
    ]
    left = [len(k) for k in kept]
    for _, layer, j in sorted(flat, key=lambda t: (math.isnan(t[0]), t[0])):
        if len(chosen) == n:
            break
        if left[layer] > 1:
            left[layer] -= 1
            chosen.append((layer, kept[layer][j]))
    for layer, head in chosen:
        kept[layer].remove(head)
    return chosen


def prune_in_order(
    model: VisionTransformer,
    model_args: Mapping[str, Any],
    order: str,
    data: MeasureData,
    score: Callable[[VisionTransformer, dict[str, Any]], tuple[float, float]],
    *,
    per_step: int,
    target: int,
    progress: Callable[[], None] = lambda: None,
) -> list[Step]:
    """Remove heads by ``order``'s measure, ``per_step`` at a time, re-scoring the heads
    left after each step (Michel et al. 2019, section 4), until ``target`` heads are gone.

    Each step's model is cut down with :func:`prune_heads` and the measure is taken on it,
    so every measure sees the model as pruned so far. A block's last head is never
    removed.

    Args:
        model: an unpruned model (uniform heads); not modified.
        model_args: its constructor arguments.
        order: a key of :data:`MEASURES`.
        data: the validation images the measure reads.
        score: (pruned model, its arguments) -> (validation accuracy in [0, 1], loss).
        per_step: heads removed per step, >= 1.
        target: heads removed in all, at most all heads but one per block.
        progress: called once per step scored.

    Returns:
        One :class:`Step` per model scored, the unpruned model first.

    Raises:
        ValueError: a model whose blocks differ in head count, or an unknown order.
    """
    counts = head_counts(model)
    if len(set(counts)) != 1:
        raise ValueError(f"pruning needs an unpruned model; its heads per block are {counts}")
    if order not in MEASURES:
        raise ValueError(f"unknown order {order!r}; the orders are {list(MEASURES)}")
    kept = [list(range(n)) for n in counts]
    removed: list[Head] = []
    step_removed: list[Head] = []
    steps = []
    while True:
        pruned, args = prune_heads(model, model_args, removed)
        steps.append(Step(order, list(removed), step_removed, *score(pruned, args)))
        progress()
        if len(removed) >= target:
            return steps
        values = MEASURES[order](pruned, data)
        step_removed = _least_important(values, kept, min(per_step, target - len(removed)))
        removed = removed + step_removed


def pruning_plan(
    total: int, depth: int, step_fraction: float, max_fraction: float
) -> tuple[int, int]:
    """(heads per step, heads to remove in all) for ``total`` heads in ``depth`` blocks:
    ``ceil(step_fraction * total)`` per step, until at least ``max_fraction`` of them are
    gone, but never a block's last head."""
    per_step = math.ceil(step_fraction * total)
    # Rounded up, as the step: "at least max_fraction", but never a block's last head.
    return per_step, min(math.ceil(max_fraction * total - 1e-9), total - depth)


def choose_step(val_accs: Sequence[float], max_drop: float) -> int:
    """The index of the most-pruned step whose validation accuracy is within ``max_drop``
    accuracy points (percent) of the unpruned model's (index 0): the last such index, so a
    curve that dips and recovers is read by where it ends up.

    Args:
        val_accs: validation accuracies (fractions), one per step, fewest heads removed
            first.
        max_drop: the accuracy the user accepts losing, in points (0.5 = 0.5%).
    """
    floor = val_accs[0] - max_drop / 100 - 1e-9
    return max(i for i, acc in enumerate(val_accs) if acc >= floor)


def best_choice(curves: Mapping[str, Sequence[Step]], max_drop: float) -> tuple[str, int]:
    """The (order, step index) to keep: of each order's :func:`choose_step`, the one with
    the most heads removed, then the higher validation accuracy, then the earlier order."""
    picks = [(o, choose_step([s.val_acc for s in steps], max_drop)) for o, steps in curves.items()]

    def rank(pick: tuple[str, int]) -> tuple[int, float]:
        step = curves[pick[0]][pick[1]]
        return len(step.removed), step.val_acc

    return max(picks, key=rank)  # max keeps the first of equals


def mean_accuracy(steps: Sequence[Step], key: str) -> float:
    """The area under the accuracy curve (``val_acc`` or ``test_acc`` against the fraction
    of heads removed, trapezoids), divided by the fraction reached: the mean accuracy over
    the pruned range, one number per order (higher: its choices cost less)."""
    x = [len(s.removed) for s in steps]
    y = [getattr(s, key) for s in steps]
    if len(x) < 2:
        return y[0]
    area = sum(
        (x1 - x0) * (y0 + y1) / 2 for x0, x1, y0, y1 in zip(x, x[1:], y, y[1:], strict=False)
    )
    return area / (x[-1] - x[0])


def images_per_second(
    models: Mapping[str, nn.Module], images: torch.Tensor, *, rounds: int = 10
) -> dict[str, float]:
    """Inference speed of each model on ``images`` (B, C, H, W), in images/s: the median of
    ``rounds`` timed passes, the models taking turns (A B A B) so that a change in the
    machine's load falls on all of them, after one untimed warm-up pass each. Eval mode,
    no gradient, float32 (autocast off), on each model's own device."""
    times: dict[str, list[float]] = {name: [] for name in models}
    device = next(iter(models.values())).parameters().__next__().device
    with torch.inference_mode(), torch.autocast(device.type, enabled=False):
        for r in range(rounds + 1):
            for name, model in models.items():
                x = images.to(next(model.parameters()).device)
                with evaluating(model):
                    start = time.perf_counter()
                    model(x)
                    if r:
                        times[name].append(time.perf_counter() - start)
    return {name: len(images) / sorted(t)[len(t) // 2] for name, t in times.items()}


def speed_and_size(
    pruned: VisionTransformer, unpruned: VisionTransformer, images: torch.Tensor
) -> dict[str, Any]:
    """The pruned model beside the unpruned one (whose weights do not matter: the speed is
    the shapes'): ``images_per_s`` (:func:`images_per_second` on ``images``, B images),
    ``speedup`` (pruned over unpruned), ``heads`` and ``params``, each per model, and the
    ``device`` line of :func:`~vit_mnist.hardware.describe_device`."""
    models = {"pruned": pruned, "unpruned": unpruned}
    speed = images_per_second(models, images)
    return {
        "images_per_s": {k: round(v, 1) for k, v in speed.items()},
        "speedup": round(speed["pruned"] / speed["unpruned"], 3),
        "heads": {k: sum(head_counts(m)) for k, m in models.items()},
        "params": {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()},
        "batch": len(images),
        "device": describe_device(next(pruned.parameters()).device),
    }


def pruning_figure(
    curves: Mapping[str, Sequence[Step]], total: int, chosen: tuple[str, int], title: str
):
    """Validation and test accuracy (%) against the heads removed, one line per order, the
    chosen step circled."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.8), dpi=110)
    axes = fig.subplots(1, 2, sharey=True)
    for ax, key, name in zip(axes, ("val_acc", "test_acc"), ("validation", "test"), strict=True):
        for order, steps in curves.items():
            x = [len(s.removed) for s in steps]
            ax.plot(
                x, [100 * getattr(s, key) for s in steps], marker="o", markersize=3, label=order
            )
        order, index = chosen
        step = curves[order][index]
        ax.plot(
            len(step.removed),
            100 * getattr(step, key),
            "o",
            markersize=11,
            fillstyle="none",
            color="black",
            label=f"kept: {order}, {total - len(step.removed)} heads",
        )
        ax.set_xticks(sorted({len(s.removed) for steps in curves.values() for s in steps}))
        ax.set(xlabel=f"heads removed (of {total})", title=f"{name} accuracy")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (%)")
    axes[1].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig
