"""Activation patching: which heads, MLPs and residual streams carry a decision between two
classes, causally, through every later layer (Meng et al. 2022, "Locating and Editing
Factual Associations in GPT"; Wang et al. 2022, "Interpretability in the Wild"; Heimersheim
and Nanda 2024, "How to use and interpret activation patching").

A pair is a clean image (class a, say a 4) and a corrupted one (class b, a 9); the metric
is the logit difference ``LD = logit_a - logit_b``. One activation (a head's output at
every token or at one token, an MLP's output, the residual stream at one token or at
all) is copied from one run into the other, the rest of the forward pass recomputed:

- **denoising** (Heimersheim and Nanda section 2.1): the corrupted run with one clean
  activation; ``(LD_patched - LD_corrupted) / (LD_clean - LD_corrupted)`` is the share of
  the decision that activation restores on its own (is it sufficient?).
- **noising**: the clean run with one corrupted activation; ``(LD_clean - LD_patched) /
  (LD_clean - LD_corrupted)`` is the share it destroys (is it necessary?).

Both are normalised from the means over the pairs (not per pair, where a small
denominator explodes), so 1 means "all of it" and 0 "none" in both directions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vit_mnist.analysis.components import Components, head_counts, resume, run_components
from vit_mnist.analysis.logit_attribution import heads_and_mlp_figure
from vit_mnist.analysis.modes import evaluating
from vit_mnist.models.vit import VisionTransformer

DIRECTIONS = ("denoising", "noising")
#: What :func:`activation_patching` patches, and the shape of each result per pair:
#: ``heads`` (depth, max heads) a head's output at every token; ``heads_by_position``
#: (depth, max heads, tokens) at one token; ``mlp`` (depth,); ``resid`` (depth, tokens) the
#: residual stream before the block at one token; ``resid_all`` (depth,) all of it.
KINDS = ("heads", "heads_by_position", "mlp", "resid", "resid_all")


# The columns of :meth:`PatchingResult.rows`, in order.
ROW_COLUMNS = ("direction", "kind", "layer", "head", "token", "score")


@dataclass
class PatchingResult:
    """Logit differences of every patched run, per pair.

    Attributes:
        clean_ld, corrupted_ld: (N,) ``logit_a - logit_b`` of the unpatched runs.
        patched: ``patched[direction][kind]``: (N, *shape) the patched runs' logit
            differences (shapes in :data:`KINDS`; NaN where a pruned block lacks a head).
        tokens: tokens per image (the prefix tokens first, then the patches).
    """

    clean_ld: torch.Tensor
    corrupted_ld: torch.Tensor
    patched: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    tokens: int = 0

    def score(self, direction: str, kind: str) -> torch.Tensor:
        """The normalised effect of each patch, (*shape) float32: the share of the mean
        logit difference restored (denoising) or destroyed (noising); see the module."""
        clean, corrupted = self.clean_ld.mean(), self.corrupted_ld.mean()
        patched = self.patched[direction][kind].mean(0)
        change = patched - corrupted if direction == "denoising" else clean - patched
        return change / (clean - corrupted)

    def rows(self, token_names: list[str]) -> list[dict[str, object]]:
        """One row per patch and direction: ``direction``, ``kind``, ``layer``, ``head``
        ("" for an MLP or the residual stream), ``token`` (a name of ``token_names``, or
        ``all``) and ``score`` (:meth:`score`); no row for a head a pruned block lacks."""
        rows = []
        for direction, patched in self.patched.items():
            for kind in patched:
                score = self.score(direction, kind)
                by_token = kind in ("heads_by_position", "resid")
                for index in (~score.isnan()).nonzero().tolist():  # row-major, as the grid
                    layer, *rest = index
                    head = rest[0] if kind.startswith("heads") else ""
                    token = token_names[rest[-1]] if by_token else "all"
                    value = round(float(score[tuple(index)]), 5)
                    cells = (direction, kind, layer, head, token, value)
                    rows.append(dict(zip(ROW_COLUMNS, cells, strict=True)))
        return rows


def _logit_difference(logits: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (logits.gather(1, a[:, None]) - logits.gather(1, b[:, None]))[:, 0]


def _patch_all(
    model: VisionTransformer,
    base: Components,
    source: Components,
    a: torch.Tensor,
    b: torch.Tensor,
    kinds: tuple[str, ...],
    chunk: int,
    progress: Callable[[], None],
) -> dict[str, torch.Tensor]:
    """Logit differences of ``base``'s run with each activation of ``source`` patched in;
    ``progress()`` after each layer."""
    n, tokens = base.embed.shape[:2]
    per_pass = max(1, chunk // n)  # variants per forward pass of about ``chunk`` images

    def run(resids: list[torch.Tensor], layer: int, after_attention: bool) -> torch.Tensor:
        """Variants of the (N, T, D) residual stream -> (variants, N) logit differences."""
        out = []
        for start in range(0, len(resids), per_pass):
            group = torch.cat(resids[start : start + per_pass])
            logits = resume(model, group, layer, after_attention=after_attention)
            repeats = len(group) // n
            out.append(_logit_difference(logits, a.repeat(repeats), b.repeat(repeats)))
        return torch.cat(out).view(len(resids), n).float().cpu()

    def one_token(delta: torch.Tensor, t: int) -> torch.Tensor:
        only = torch.zeros_like(delta)
        only[:, t] = delta[:, t]
        return only

    most = max(head_counts(model))

    def padded(values: torch.Tensor) -> torch.Tensor:  # (N, h, ...) -> (N, most heads, ...)
        out = torch.full((n, most, *values.shape[2:]), float("nan"))
        out[:, : values.shape[1]] = values
        return out

    results: dict[str, list[torch.Tensor]] = {k: [] for k in kinds}
    for layer in range(model.depth):
        heads = base.heads[layer].shape[1]
        delta = source.heads[layer] - base.heads[layer]  # (N, h, T, D)
        mid = base.resid_mid[layer]
        if "heads" in kinds:
            variants = [mid + delta[:, i] for i in range(heads)]
            results["heads"].append(padded(run(variants, layer, True).T))  # (N, H)
        if "heads_by_position" in kinds:
            variants = [
                mid + one_token(delta[:, i], t) for i in range(heads) for t in range(tokens)
            ]
            ld = run(variants, layer, True).T.reshape(n, heads, tokens)
            results["heads_by_position"].append(padded(ld))  # (N, H, T)
        if "mlp" in kinds:
            post = base.resid_post[layer] + source.mlp[layer] - base.mlp[layer]
            results["mlp"].append(run([post], layer + 1, False)[0])  # (N,)
        pre, pre_source = base.resid_pre[layer], source.resid_pre[layer]
        if "resid" in kinds:
            variants = [pre + one_token(pre_source - pre, t) for t in range(tokens)]
            results["resid"].append(run(variants, layer, False).T)  # (N, T)
        if "resid_all" in kinds:
            results["resid_all"].append(run([pre_source], layer, False)[0])  # (N,)
        progress()
    return {kind: torch.stack(per_layer, dim=1) for kind, per_layer in results.items()}


@torch.no_grad()
def activation_patching(
    model: VisionTransformer,
    clean: torch.Tensor,
    corrupted: torch.Tensor,
    clean_class: int | torch.Tensor | None = None,
    corrupted_class: int | torch.Tensor | None = None,
    *,
    directions: tuple[str, ...] = DIRECTIONS,
    kinds: tuple[str, ...] = KINDS,
    chunk: int = 4096,
    progress: Callable[[], None] = lambda: None,
) -> PatchingResult:
    """Patch every head output (at every token and at each token), every MLP output and
    the residual stream before every block (at each token and whole) between pairs of
    images, in both directions, and return the logit differences.

    Each patched run starts from the unpatched run's residual stream at the patched layer
    (the earlier layers do not change) and recomputes the rest with the model's own
    modules; the patched variants of all pairs run as batches of about ``chunk`` images.
    The model runs in eval mode in float32 with autocast off; its mode is restored.

    Args:
        model: a :class:`VisionTransformer` (distilled and pruned ones included).
        clean: (N, C, H, W) float images of class a, normalised as the model was trained.
        corrupted: (N, C, H, W) the pairs' other images, of class b.
        clean_class, corrupted_class: a and b of ``logit_a - logit_b``, ints or (N,) int
            tensors; None: the model's prediction on the clean (corrupted) image.
        directions: a subset of :data:`DIRECTIONS`.
        kinds: a subset of :data:`KINDS`.
        chunk: images per forward pass (memory, not results).
        progress: called once per direction and layer patched: ``len(directions) *
            model.depth`` calls.

    Returns:
        :class:`PatchingResult`, on the CPU; ``score(direction, kind)`` normalises it.

    Raises:
        ValueError: ``clean`` and ``corrupted`` of other shapes, an unknown direction or
            kind.
    """
    if clean.shape != corrupted.shape:
        raise ValueError(
            f"clean {tuple(clean.shape)} and corrupted {tuple(corrupted.shape)} images must "
            "pair up one to one"
        )
    unknown = sorted(set(directions) - set(DIRECTIONS)) + sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown {unknown}: directions are {DIRECTIONS}, kinds {KINDS}")
    parameter = next(model.parameters())
    device = parameter.device
    with evaluating(model), torch.autocast(device.type, enabled=False):
        runs = [run_components(model, x.to(device, parameter.dtype)) for x in (clean, corrupted)]

        def classes(given, c: Components) -> torch.Tensor:
            if given is None:
                return c.logits.argmax(1)
            return torch.as_tensor(given, device=device).expand(len(clean)).long()

        a, b = classes(clean_class, runs[0]), classes(corrupted_class, runs[1])
        lds = [_logit_difference(c.logits, a, b).float().cpu() for c in runs]
        result = PatchingResult(lds[0], lds[1], tokens=runs[0].embed.shape[1])
        for direction in directions:
            base, source = runs[::-1] if direction == "denoising" else runs
            result.patched[direction] = _patch_all(
                model, base, source, a, b, kinds, chunk, progress
            )
    return result


def patching_figures(
    model: VisionTransformer,
    results: list[tuple[str, PatchingResult]],
    token_names: list[str],
    title: str,
):
    """Two figures of labelled results (one per pair of classes): layers x (heads, MLP)
    heat maps of both directions' scores, and layers x tokens heat maps of the denoised
    residual stream (where the decision sits, token by token), on the scale -1 .. 1."""
    from vit_mnist.analysis.drawing import heatmap_panels

    words = {"denoising": "restored", "noising": "destroyed"}
    panels = [(label, result, direction) for label, result in results for direction in DIRECTIONS]
    by_head = heads_and_mlp_figure(
        model,
        torch.stack([result.score(direction, "heads") for _, result, direction in panels]),
        torch.stack([result.score(direction, "mlp") for _, result, direction in panels]),
        titles=[f"{label}: {direction} ({words[direction]})" for label, _, direction in panels],
        colorbar_label="share of the logit difference",
        title=title,
        limit=1.0,
        columns=2,
    )
    by_token = heatmap_panels(
        torch.stack([r.score("denoising", "resid") for _, r in results]),
        titles=[f"{label}: residual stream, denoising" for label, _ in results],
        row_labels=[f"before layer {layer}" for layer in range(model.depth)],
        col_labels=token_names,
        x_label="token (patch row,column)",
        colorbar_label="share of the logit difference restored",
        title=title,
        limit=1.0,
        columns=1,
    )
    return by_head, by_token
