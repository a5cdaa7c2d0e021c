"""The analyses ``eval.py analysis=...`` adds to a checkpoint's test: each reads an
:class:`EvalRun` and writes its CSV, figures and TensorBoard events into the run dir, prints
a summary and returns its metrics (heads, roles, circuits, faithfulness; prune has its
own module, :mod:`vit_mnist.tasks.evaluate.pruning`)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torchmetrics.functional.regression import spearman_corrcoef

from vit_mnist.analysis.attention import head_statistics
from vit_mnist.analysis.components import head_counts
from vit_mnist.analysis.faithfulness import (
    explanation_maps,
    faithfulness_figure,
    perturbation_passes,
    perturbation_test,
)
from vit_mnist.analysis.heads import (
    class_head_importance,
    gradient_head_importance,
    head_importance,
    head_importance_figure,
)
from vit_mnist.analysis.logit_attribution import (
    attribution_figure,
    attribution_rows,
    direct_logit_attribution,
    margin_attribution,
)
from vit_mnist.analysis.logit_lens import lens_figure, logit_lens
from vit_mnist.analysis.patching import DIRECTIONS, activation_patching, patching_figures
from vit_mnist.analysis.patching import ROW_COLUMNS as PATCHING_COLUMNS
from vit_mnist.analysis.roles import ROLE_COLUMNS, head_roles, parts_figure, roles_figure
from vit_mnist.console import progress
from vit_mnist.errors import ConfigError
from vit_mnist.io import save_figure, save_png, write_csv
from vit_mnist.models.vit import VisionTransformer
from vit_mnist.training.module import ViTClassifier

log = logging.getLogger(__name__)


@dataclass
class EvalRun:
    """What every analysis of :func:`evaluate` reads, and where it writes.

    ``images`` (N, C, H, W) are the split's, normalised as the model takes them, in the
    order of ``loader``; ``labels`` (N,) int64 their classes; ``device`` is where the model
    is tested; ``writer`` is TensorBoard's ``SummaryWriter``, None without a TensorBoard
    logger; files go to the run dir ``out``.
    """

    module: ViTClassifier
    loader: Any
    images: torch.Tensor
    labels: torch.Tensor
    class_names: list[str]
    device: torch.device
    out: Path
    writer: Any

    def publish(self, picture, name: str) -> None:
        """A picture to ``out/<name>.png`` and to TensorBoard (tag ``name``): a (3, H, W)
        uint8 image tensor, or a matplotlib figure."""
        if isinstance(picture, torch.Tensor):
            save_png(picture, self.out / f"{name}.png")
            if self.writer is not None:
                self.writer.add_image(name, picture)
            return
        if self.writer is not None:
            self.writer.add_figure(name, picture, close=False)
        save_figure(picture, self.out / f"{name}.png")

    def scalars(self, values: dict[str, float], step: int | None = None) -> None:
        """Each ``tag: value`` as a TensorBoard scalar."""
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def head_scalars(self, rows: list[dict[str, Any]], columns: dict[str, str]) -> None:
        """For each ``tag: column`` of ``columns``, the scalars ``<tag>/layer_<l>/head_<h>``
        of the rows that are heads."""
        for r in rows:
            if r["head"] != "":
                where = f"layer_{r['layer']}/head_{r['head']}"
                self.scalars({f"{tag}/{where}": r[column] for tag, column in columns.items()})


def _add_head_statistics(model: VisionTransformer, images: torch.Tensor, rows) -> None:
    """Add each head's attention ``entropy_nats`` and ``mean_distance_px`` to its row ("" in
    the rows that are not a head)."""
    # The first 1 000 images: plenty for a per-head mean.
    entropy, distance = head_statistics(model, images[:1000])
    for r in rows:
        head = r["head"] != ""
        r["entropy_nats"] = round(float(entropy[r["layer"], r["head"]]), 4) if head else ""
        r["mean_distance_px"] = round(float(distance[r["layer"], r["head"]]), 3) if head else ""


def analyse_heads(trainer: L.Trainer, run: EvalRun, *, bar: bool = True) -> dict[str, Any]:
    """Head importance (ablation and gradient) and head statistics, written as CSV, PNG
    and TensorBoard scalars; ``bar``: progress bars (one pass over the test images per
    head, then one backward pass per batch).

    Returns:
        ``head_importance``: ``baseline`` (``acc``, ``loss``) and ``heads`` (the CSV rows),
        and ``heads/spearman_grad_vs_ablation``: the Spearman rank correlation over all
        heads between the gradient importance and the loss increase when the head is
        zeroed, in [-1, 1] (NaN when either is constant).
    """
    model = run.module.net
    with progress(sum(head_counts(model)) + 1, "heads zeroed", enabled=bar) as shown:
        baseline, rows = head_importance(trainer, run.module, run.loader, progress=shown.update)
    # One backward pass per test batch, in float32 (Michel et al. 2019, eq. 2).
    with progress(len(run.loader), "gradient importance", enabled=bar) as shown:
        device = trainer.strategy.root_device
        grad = gradient_head_importance(model, run.loader, device=device, progress=shown.update)
    for r in rows:
        r["grad_importance"] = round(float(grad[r["layer"], r["head"]]), 6)
    _add_head_statistics(model, run.images, rows)
    tags = {"head_importance/acc_drop": "acc_drop", "head_importance/grad": "grad_importance"}
    run.head_scalars(rows, tags)
    # Against the loss increase, not the accuracy drop: the gate gradient is the first-order
    # estimate of exactly that loss change, and on a ~99% model most heads' accuracy drops
    # are a few images, with ties that leave a rank correlation little to rank.
    loss_increase = torch.tensor([r["loss_increase"] for r in rows], dtype=torch.float64)
    spearman = float(spearman_corrcoef(grad.flatten().double(), loss_increase))
    log.info(
        "Spearman rank correlation of gradient head importance with the loss increase when "
        "the head is zeroed: %.3f (%d heads)",
        spearman,
        len(rows),
    )
    run.scalars({"heads/spearman_grad_vs_ablation": spearman})
    write_csv(run.out / "head_importance.csv", rows)
    title = f"test accuracy {100 * baseline['acc']:.2f}%: drop when one head is zeroed"
    heads = max(block.attn.num_heads for block in model.blocks)
    run.publish(head_importance_figure(rows, model.depth, heads, title), "head_importance")
    print(
        f"{'layer':>5} {'head':>4} {'acc':>7} {'drop':>7} {'loss_up':>8} {'grad':>8} "
        f"{'entropy':>8} {'dist_px':>8}"
    )
    for r in rows:
        print(
            f"{r['layer']:>5} {r['head']:>4} {100 * r['acc']:6.2f}% {100 * r['acc_drop']:6.2f} "
            f"{r['loss_increase']:8.4f} {r['grad_importance']:8.4f} "
            f"{r['entropy_nats']:8.3f} {r['mean_distance_px']:8.2f}"
        )
    return {
        "heads/spearman_grad_vs_ablation": spearman,
        "head_importance": {"baseline": baseline, "heads": rows},
    }


def analyse_roles(
    trainer: L.Trainer, run: EvalRun, pixels: torch.Tensor, *, bar: bool = True
) -> list[dict[str, Any]]:
    """What each head does (:mod:`vit_mnist.analysis.roles`): ``roles.csv``,
    ``roles.png``, ``roles_parts.png`` (the stroke ends and curves found on the first 20
    images) and TensorBoard (the two figures, scalars ``roles/<figure>/layer_<l>/head_<h>``).

    Args:
        pixels: ``run.images`` in [0, 1], ink bright.
        bar: progress bars (per batch of images, then per pass with a head zeroed).

    Returns:
        The CSV's rows: ``layer``, ``head``, the role figures (``ROLE_COLUMNS``), and the
        per-class accuracy drops of :func:`class_head_importance`.
    """
    names = run.class_names
    model, batch = run.module.net, 250
    with progress(math.ceil(len(pixels) / batch), "head roles", enabled=bar) as shown:
        rows = head_roles(model, run.images, pixels, batch_size=batch, progress=shown.update)
    with progress(sum(head_counts(model)) + 1, "heads zeroed", enabled=bar) as shown:
        drops = class_head_importance(trainer, run.module, run.loader, names, progress=shown.update)
    for row, drop in zip(rows, drops, strict=True):
        row.update({k: v for k, v in drop.items() if k not in ("layer", "head")})
    write_csv(run.out / "roles.csv", rows)
    run.head_scalars(rows, {f"roles/{key}": key for key in (*ROLE_COLUMNS, "acc_drop")})
    title = f"what each head looks at, {len(pixels)} images"
    run.publish(roles_figure(rows, names, title), "roles")
    title = "skeleton (white), stroke ends (red circles), curves (blue squares)"
    shown = [names[int(c)] for c in run.labels[:20]]
    run.publish(parts_figure(pixels[:20], shown, title), "roles_parts")
    print(
        f"{'layer':>5} {'head':>4} {'ink':>11} {'centre_px':>11} {'ends':>11} {'curves':>11} "
        f"{'dist_px':>7} {'entropy':>7} {'drop':>6}  most hurt"
    )
    for r in rows:
        print(
            f"{r['layer']:>5} {r['head']:>4} {r['ink_share']:5.2f}/{r['ink_area']:<5.2f} "
            f"{r['centre_distance_px']:5.2f}/{r['centre_distance_uniform_px']:<5.2f} "
            f"{r['end_share']:5.2f}/{r['end_area']:<5.2f} "
            f"{r['curve_share']:5.2f}/{r['curve_area']:<5.2f} "
            f"{r['mean_distance_px']:7.2f} {r['entropy_nats']:7.3f} {100 * r['acc_drop']:6.2f}  "
            f"{r['most_hurt_class']}"
        )
    print(
        "(ink, ends, curves: the CLS token's attention share / the area share; centre: "
        "attended / uniform distance to the centre of ink mass)"
    )
    return rows


def check_class_pairs(pairs, num_classes: int) -> None:
    """Raise ConfigError for a ``circuits.pairs`` class the model does not have."""
    for pair in pairs or []:
        for c in pair:
            if c >= num_classes:
                raise ConfigError(
                    f"circuits.pairs: class {c} in {list(pair)} is outside 0..{num_classes - 1} "
                    f"(the checkpoint's model has {num_classes} classes); "
                    "e.g. circuits.pairs=[[4,9]]"
                )


def circuit_pairs(cm: torch.Tensor, settings) -> list[tuple[int, int]]:
    """The (clean, corrupted) class pairs that ``analysis=circuits`` patches: ``pairs`` when
    given, else the ``num_pairs`` most confused pairs of the confusion matrix ``cm``
    (K, K) (rows true, columns predicted): by errors in either direction, each oriented from
    the class more often taken for the other; pairs never confused are left out."""
    if settings.get("pairs"):
        return [(int(a), int(b)) for a, b in settings.pairs]
    errors = (cm + cm.T).triu(1)  # (K, K): errors between a and b, either way, a < b
    order = errors.flatten().argsort(descending=True)[: int(settings.num_pairs)]
    confused = [divmod(i, cm.shape[0]) for i in order.tolist()]
    return [(a, b) if cm[a, b] >= cm[b, a] else (b, a) for a, b in confused if errors[a, b] > 0]


def token_names(model: VisionTransformer) -> list[str]:
    """Names of the tokens: ``CLS`` (``dist``), then the patches as ``row,col``."""
    grid = model.patch_embed.grid_size
    prefix = ["CLS", "dist"][: model.num_prefix_tokens]
    return prefix + [f"{r},{c}" for r in range(grid) for c in range(grid)]


def analyse_circuits(
    run: EvalRun, pairs: list[tuple[int, int]], *, pair_images: int, bar: bool = True
) -> dict:
    """What each head writes: direct logit attribution (per head and class), the logit
    lens and activation patching between class pairs, as CSV, PNG, TensorBoard and a
    terminal summary (:mod:`vit_mnist.analysis.logit_attribution`,
    :mod:`~vit_mnist.analysis.logit_lens`, :mod:`~vit_mnist.analysis.patching`).

    For each (a, b) of ``pairs`` the first ``pair_images`` images of class a and of class
    b that the model classifies right are paired in order; ``logit_a - logit_b`` is the
    metric. A distilled model's attribution is its CLS head's (the prediction averages two
    heads' softmax, which is not a sum). ``bar``: a progress bar of the patching, one step
    per pair, direction and layer.

    Writes ``circuits_heads.csv`` (per component: mean direct contribution to the true
    class and to the margin over the runner-up, overall and per class, and each head's
    attention entropy and distance), ``circuits_lens.csv``, ``circuits_patching.csv`` (one
    row per patch: pair, direction, kind, layer, head, token, score) and the figures
    ``circuits_attribution.png``, ``circuits_lens.png``, ``circuits_patching.png``,
    ``circuits_patching_tokens.png``.

    Returns:
        ``circuits/lens_accuracy`` and ``circuits/lens_agreement`` (one fraction per
        block), ``circuits/pairs`` (the pairs patched, with their image counts) and
        ``circuits/num_images``.
    """
    model, images, labels, names = run.module.net, run.images, run.labels, run.class_names
    model.to(run.device)
    try:
        attribution = direct_logit_attribution(model, images)
        rows = attribution_rows(attribution, labels, names)
        _add_head_statistics(model, images, rows)  # where a head looks, beside what it writes
        lens = logit_lens(model, images, labels)
        right = lens.predictions[:, -1] == labels
        patched = _patch_pairs(model, images[right], labels[right], pairs, pair_images, bar)
    finally:
        model.cpu()
    write_csv(run.out / "circuits_heads.csv", rows)
    write_csv(run.out / "circuits_lens.csv", lens.rows(names))
    tokens = token_names(model)
    patch_rows = [
        {"clean": names[a], "corrupted": names[b], "pairs": n, **row}
        for (a, b, n), result in patched
        for row in result.rows(tokens)
    ]
    # The columns named: with no pair patched (a warning above), the file is its header.
    columns = ["clean", "corrupted", "pairs", *PATCHING_COLUMNS]
    write_csv(run.out / "circuits_patching.csv", patch_rows, columns)
    margin = margin_attribution(attribution, labels)[1]
    title = f"direct logit attribution to the margin over the runner-up class, {len(images)} images"
    figure = attribution_figure(model, attribution, margin, labels, names, title)
    run.publish(figure, "circuits_attribution")
    run.publish(lens_figure(lens, names, f"logit lens, {len(images)} images"), "circuits_lens")
    if patched:
        labelled = [(f"{names[a]} vs {names[b]} ({n} pairs)", r) for (a, b, n), r in patched]
        by_head, by_token = patching_figures(
            model, labelled, tokens, "activation patching: share of logit_a - logit_b"
        )
        run.publish(by_head, "circuits_patching")
        run.publish(by_token, "circuits_patching_tokens")
    run.head_scalars(rows, {"circuits/to_margin": "to_margin"})
    for layer in range(model.depth):
        lens_at = {"accuracy": lens.accuracy[layer], "agreement": lens.agreement[layer]}
        run.scalars({f"circuits/lens_{k}": float(v) for k, v in lens_at.items()}, layer)
    _print_circuits(rows, lens, patched, names)
    return {
        "circuits/num_images": len(images),
        "circuits/lens_accuracy": [round(float(v), 6) for v in lens.accuracy],
        "circuits/lens_agreement": [round(float(v), 6) for v in lens.agreement],
        "circuits/pairs": [[names[a], names[b], n] for (a, b, n), _ in patched],
    }


def _patch_pairs(model, images, labels, pairs, pair_images: int, bar: bool) -> list:
    """``((a, b, n), PatchingResult)`` for each pair (a, b) with images of both classes:
    the first ``n <= pair_images`` of ``images`` of class a paired in order with those of
    class b; a progress bar of one step per pair, direction and layer."""
    patched, per_pair = [], len(DIRECTIONS) * model.depth
    with progress(len(pairs) * per_pair, "activation patching", enabled=bar) as shown:
        for a, b in pairs:
            clean, corrupted = images[labels == a][:pair_images], images[labels == b][:pair_images]
            n = min(len(clean), len(corrupted))
            if n == 0:
                log.warning("no correctly classified images of %s or %s to patch", a, b)
                shown.update(per_pair)
                continue
            result = activation_patching(
                model, clean[:n], corrupted[:n], a, b, progress=shown.update
            )
            patched.append(((a, b, n), result))
    return patched


def _print_circuits(rows, lens, patched, names) -> None:
    """The terminal summary of :func:`analyse_circuits`."""
    print("direct logit attribution (logits, mean over images; margin = true - runner-up)")
    print(f"{'component':>10} {'to_true':>8} {'to_margin':>9}  {'top class':<9} entropy dist_px")
    for r in rows:
        looks = f"{r['entropy_nats']:7.3f} {r['mean_distance_px']:7.2f}" if r["head"] != "" else ""
        print(
            f"{r['component']:>10} {r['to_true']:8.3f} {r['to_margin']:9.3f}  "
            f"{r['top_class']:<9} {looks}"
        )
    accuracy = " ".join(f"{100 * float(v):.1f}%" for v in lens.accuracy)
    print(f"logit lens, accuracy after each block: {accuracy}")
    for (a, b, n), result in patched:
        restored, destroyed = (result.score(d, "heads").flatten() for d in DIRECTIONS)
        width = result.score("denoising", "heads").shape[1]
        order = restored.nan_to_num(float("-inf")).argsort(descending=True)[:3].tolist()
        best = ", ".join(
            f"L{i // width}H{i % width} {float(restored[i]):.2f}/{float(destroyed[i]):.2f}"
            for i in order
        )
        mlp, mlp_noised = (result.score(d, "mlp") for d in DIRECTIONS)
        top = int(mlp.argmax())
        print(
            f"patching {names[a]} vs {names[b]} ({n} pairs), restored/destroyed: heads {best}; "
            f"MLP L{top} {float(mlp[top]):.2f}/{float(mlp_noised[top]):.2f}"
        )


def analyse_faithfulness(
    run: EvalRun, num_images: int, *, fill: float, seed: int, bar: bool = True
) -> dict:
    """The perturbation test of every explanation method on the first ``num_images`` of
    ``run.images``, written as ``faithfulness.csv``, ``faithfulness.png`` and TensorBoard.

    Blanked patches take the value ``fill`` (the normalised background); ``seed`` seeds
    the random baseline. The model is moved to ``run.device`` for the test and back to the
    CPU afterwards. ``bar``: a progress bar, one step per accuracy measured.

    Returns:
        ``faithfulness/<method>/positive_auc`` and ``.../negative_auc`` (areas in [0, 1]
        under accuracy vs. fraction of patches blanked) and ``faithfulness/num_images``.
    """
    model, images, labels = run.module.net, run.images[:num_images], run.labels[:num_images]
    model.to(run.device)
    try:
        scores = explanation_maps(model, images, seed=seed)
        with progress(perturbation_passes(scores), "perturbation test", enabled=bar) as shown:
            result = perturbation_test(
                model, images, labels, scores, fill=fill, progress=shown.update
            )
    finally:
        model.cpu()
    rows = result.rows()
    write_csv(run.out / "faithfulness.csv", rows)
    keys = ("positive_auc", "negative_auc")
    aucs = {f"faithfulness/{r['method']}/{k}": r[k] for r in rows for k in keys}
    run.scalars(aucs)
    title = (
        f"perturbation test on {result.num_images} test images: blanked patches take the "
        f"black background ({fill:.4f} normalised)"
    )
    run.publish(faithfulness_figure(result, title), "faithfulness")
    print(f"perturbation test on {result.num_images} test images ({len(result.fractions)} steps)")
    print(f"{'method':>10} {'positive_auc':>13} {'negative_auc':>13}")
    for r in rows:
        print(f"{r['method']:>10} {r['positive_auc']:13.4f} {r['negative_auc']:13.4f}")
    print("(positive: most relevant patches blanked first, lower is better; negative: higher)")
    return {"faithfulness/num_images": result.num_images, **aucs}
