"""What each head does, in the words of the claims the project started from: does a head
follow the ink, the centre of mass, the stroke ends, the curves; is it local or global;
which digits need it.

The figures come from the CLS token's attention over the patches (the row that reaches
the classification head, ViT eq. 4), renormalised over the patches so that the CLS
token's attention to itself does not count, and from the digit itself: its ink, its
centre of ink mass, and the end points and high-curvature points of its skeleton. Each
attention share is reported beside the share of the area those patches cover, which is
what a head that looks everywhere alike (a uniform map) would give: a head prefers a
part of the digit when its share is above that area.

Methods: mean attention distance and entropy as in Dosovitskiy et al. 2021, Appendix D.7,
and Raghu et al. 2021 ("Do Vision Transformers See Like Convolutional Neural Networks?",
local and global heads); roles found by what a head attends to and what removing it
breaks, as in Voita et al. 2019 ("Analyzing Multi-Head Self-Attention: Specialized Heads
Do the Heavy Lifting, the Rest Can Be Pruned"); the skeleton by scikit-image's
``skeletonize`` (Zhang and Suen 1984); high-curvature points by the Harris corner
detector (Harris and Stephens 1988, scikit-image's ``corner_harris``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from einops import reduce
from scipy import ndimage
from skimage.feature import corner_harris, corner_peaks
from skimage.morphology import skeletonize

from vit_mnist.analysis.attention import (
    attention_batches,
    attention_entropy,
    mean_attention_distance,
)
from vit_mnist.models.vit import VisionTransformer

INK_THRESHOLD = 0.5  # of the [0, 1] pixel scale: MNIST's strokes are near 1, paper near 0
# Harris corners weaker than this share of the strongest in the digit are not curves.
CURVE_THRESHOLD_REL = 0.2
# A corner this close (pixels, either axis) to a stroke end is that end, not a curve.
END_RADIUS_PX = 2
# The role figures, in the order of roles.csv's columns after layer and head.
ROLE_COLUMNS = (
    "ink_share",
    "ink_area",
    "centre_distance_px",
    "centre_distance_uniform_px",
    "end_share",
    "end_area",
    "curve_share",
    "curve_area",
    "mean_distance_px",
    "entropy_nats",
)


@dataclass
class DigitParts:
    """Where a batch of digits' parts lie, per patch.

    Attributes:
        ink: (N, P) bool, the patch holds ink (a pixel at or above ``INK_THRESHOLD``).
        ends: (N, P) bool, the patch holds an end point of the digit's skeleton.
        curves: (N, P) bool, the patch holds a high-curvature point of the skeleton.
        centre_distance: (N, P) float32, pixels from the patch's centre to the digit's
            centre of ink mass (the mean position weighted by the pixel intensities,
            clipped to [0, 1]; the image's centre for a blank image).
        P = (H / patch_size)**2 patches in row-major order, as the model numbers them.
    """

    ink: torch.Tensor
    ends: torch.Tensor
    curves: torch.Tensor
    centre_distance: torch.Tensor


def skeleton_points(ink: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stroke end points and high-curvature points of one digit's skeleton.

    The skeleton is scikit-image's ``skeletonize`` of the ink mask. An end point is a
    skeleton pixel with exactly one skeleton pixel among its 8 neighbours. A
    high-curvature point is a peak of the Harris corner response of the skeleton
    (``corner_harris``, sigma 1 pixel; ``corner_peaks`` at least 2 pixels apart and at
    least ``CURVE_THRESHOLD_REL`` of the strongest), at most 1 pixel from the skeleton and
    more than ``END_RADIUS_PX`` from every end point (the end of a stroke is a corner to
    Harris too).

    Args:
        ink: (H, W) bool mask.

    Returns:
        ``(ends, curves)``, two (H, W) bool masks.
    """
    skeleton = skeletonize(ink)
    neighbours = ndimage.convolve(
        skeleton.astype(np.uint8), np.ones((3, 3), np.uint8), mode="constant"
    )
    ends = skeleton & (neighbours == 2)  # the pixel itself and one neighbour
    curves = np.zeros_like(skeleton)
    if skeleton.sum() < 3:
        return ends, curves
    response = corner_harris(skeleton.astype(np.float64), sigma=1.0)
    peaks = corner_peaks(response, min_distance=2, threshold_rel=CURVE_THRESHOLD_REL)
    near_skeleton = ndimage.binary_dilation(skeleton, np.ones((3, 3), bool))
    near_end = ndimage.binary_dilation(ends, np.ones((2 * END_RADIUS_PX + 1,) * 2, bool))
    for r, c in peaks:
        if near_skeleton[r, c] and not near_end[r, c]:
            curves[r, c] = True
    return ends, curves


def digit_parts(pixels: torch.Tensor, patch_size: int) -> DigitParts:
    """The :class:`DigitParts` of ``pixels`` for a model with patches of ``patch_size``.

    Args:
        pixels: (N, H, W) or (N, 1, H, W) float in [0, 1], ink bright (as MNIST stores
            it), not normalised.
        patch_size: pixels per patch side; divides H and W.

    Raises:
        ValueError: a patch size that does not divide the image.
    """
    pixels = pixels.reshape(pixels.shape[0], *pixels.shape[-2:]).float().cpu()
    n, height, width = pixels.shape
    if height % patch_size or width % patch_size:
        raise ValueError(f"patch_size={patch_size} does not divide {height} x {width} images")
    ink = (pixels >= INK_THRESHOLD).numpy()
    ends, curves = np.zeros_like(ink), np.zeros_like(ink)
    for i in range(n):
        ends[i], curves[i] = skeleton_points(ink[i])

    def per_patch(mask: np.ndarray) -> torch.Tensor:  # (N, H, W) -> (N, P): any pixel set
        pattern = "n (gh p) (gw q) -> n (gh gw)"
        return reduce(torch.from_numpy(mask), pattern, "any", p=patch_size, q=patch_size)

    weight = pixels.clamp(0, 1)
    mass = weight.sum(dim=(1, 2))
    rows = torch.arange(height, dtype=torch.float32)
    cols = torch.arange(width, dtype=torch.float32)
    centre = (
        torch.stack([(weight.sum(2) * rows).sum(1), (weight.sum(1) * cols).sum(1)], dim=1)
        / mass.clamp_min(1e-12)[:, None]
    )  # (N, 2) row, column in pixels
    # A blank image has no centre of ink mass: the image's centre stands in.
    centre[mass <= 0] = torch.tensor([(height - 1) / 2, (width - 1) / 2])
    # Patch centres in the same pixel coordinates: patch i spans pixels i*p .. i*p + p - 1.
    offsets = torch.arange(0, height, patch_size, dtype=torch.float32) + (patch_size - 1) / 2
    grid = torch.cartesian_prod(offsets, offsets)  # (P, 2) row-major, as the model numbers them
    distance = torch.linalg.vector_norm(grid[None] - centre[:, None], dim=-1)
    return DigitParts(per_patch(ink), per_patch(ends), per_patch(curves), distance)


@torch.no_grad()
def head_roles(
    model: VisionTransformer,
    images: torch.Tensor,
    pixels: torch.Tensor,
    *,
    batch_size: int = 250,
    progress: Callable[[], None] = lambda: None,
) -> list[dict[str, Any]]:
    """The role figures of every head (:data:`ROLE_COLUMNS`), averaged over ``images``.

    - ``ink_share``: the share of the CLS token's attention on patches that hold ink;
      ``ink_area``: the share of patches that hold ink (a uniform map's share).
    - ``centre_distance_px``: the attention-weighted distance of the attended patches'
      centres from the digit's centre of ink mass, pixels; ``..._uniform_px``: the same
      for a uniform map. Below the uniform figure: the head looks at the centre.
    - ``end_share`` / ``end_area``, ``curve_share`` / ``curve_area``: as ink, for the
      patches holding stroke end points and high-curvature points
      (:func:`skeleton_points`). A digit without such points adds 0 to both.
    - ``mean_distance_px`` (Dosovitskiy et al. 2021, D.7; every patch query, not the CLS
      token) and ``entropy_nats`` (every query), as :func:`head_statistics` computes them.

    Args:
        model: a :class:`VisionTransformer` (pruned blocks allowed).
        images: (N, C, H, W) float, as the model takes them (normalised).
        pixels: the same N images in [0, 1], ink bright (see :func:`digit_parts`).
        batch_size: images per forward pass.
        progress: called once per batch of ``batch_size`` images (its digit parts found
            and its attention read): ``ceil(N / batch_size)`` calls.

    Returns:
        One dict per (layer, head): ``layer``, ``head`` and the role figures (floats).

    Raises:
        ValueError: ``images`` and ``pixels`` differ in count, or see :func:`digit_parts`.
    """
    if len(images) != len(pixels) or len(images) == 0:
        raise ValueError(f"{len(images)} images and {len(pixels)} pixel maps: give the same N > 0")
    grid, patch = model.patch_embed.grid_size, model.patch_embed.patch_size
    heads = [block.attn.num_heads for block in model.blocks]
    sums = torch.zeros(model.depth, max(heads), len(ROLE_COLUMNS), dtype=torch.float64)
    for chunk, weights in attention_batches(model, images, batch_size):
        # The batch's parts: the skeletons take most of the time, so the batch is the
        # unit of progress.
        parts = digit_parts(pixels[chunk], patch)
        areas = {
            "ink_area": parts.ink.float().mean(1),
            "centre_distance_uniform_px": parts.centre_distance.mean(1),
            "end_area": parts.ends.float().mean(1),
            "curve_area": parts.curves.float().mean(1),
        }
        per_patch = {
            "ink_share": parts.ink.float(),
            "centre_distance_px": parts.centre_distance,
            "end_share": parts.ends.float(),
            "curve_share": parts.curves.float(),
        }
        n = per_patch["ink_share"].shape[0]
        for layer, w in enumerate(weights):
            w = w.float().cpu()
            cls = w[:, :, 0, -(grid * grid) :]  # over the patches, the last tokens
            cls = cls / cls.sum(-1, keepdim=True).clamp_min(1e-12)  # (B, h, P)
            figures = {k: (cls * v[:, None]).sum(-1).sum(0) for k, v in per_patch.items()}
            figures.update({k: v.sum().expand(w.shape[1]) for k, v in areas.items()})
            figures["mean_distance_px"] = n * mean_attention_distance(
                w, grid_size=grid, patch_size=patch
            )
            figures["entropy_nats"] = n * attention_entropy(w)
            for i, key in enumerate(ROLE_COLUMNS):
                sums[layer, : w.shape[1], i] += figures[key].double()
        progress()
    means = sums / len(images)
    return [
        {
            "layer": layer,
            "head": head,
            **{key: round(float(means[layer, head, i]), 5) for i, key in enumerate(ROLE_COLUMNS)},
        }
        for layer, count in enumerate(heads)
        for head in range(count)
    ]


def roles_figure(rows: Sequence[dict[str, Any]], class_names: Sequence[str], title: str):
    """Every head placed on the role axes: four panels, one point per head labelled
    ``layer:head`` and coloured by layer.

    1. ink: attention share on ink patches over their area share (1 = no preference),
       against the distance to the centre of ink mass over a uniform map's (below 1 =
       looks at the centre);
    2. stroke ends and curves: each part's lift (share over area) over the ink lift (above
       1 = prefers that part to the rest of the ink);
    3. mean attention distance (pixels) against entropy (nats): local and global heads;
    4. accuracy drop (points) per class when the head is zeroed (``acc_drop_<class>``).

    Returns:
        A matplotlib figure.
    """
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    def ratio(r, share, area):
        return r[share] / r[area] if r[area] > 0 else float("nan")

    def over_ink(r, part):
        return ratio(r, f"{part}_share", f"{part}_area") / ratio(r, "ink_share", "ink_area")

    depth = 1 + max(r["layer"] for r in rows)
    colours = colormaps["viridis"](np.linspace(0, 0.9, depth))
    fig = Figure(figsize=(11, 9.5), dpi=100)
    axes = fig.subplots(2, 2)
    panels = [
        (
            axes[0, 0],
            [ratio(r, "ink_share", "ink_area") for r in rows],
            [ratio(r, "centre_distance_px", "centre_distance_uniform_px") for r in rows],
            "ink: attention share / area share",
            "distance to the ink's centre / uniform map's",
        ),
        (
            axes[0, 1],
            [over_ink(r, "end") for r in rows],
            [over_ink(r, "curve") for r in rows],
            "stroke ends: lift / ink lift",
            "curves: lift / ink lift",
        ),
        (
            axes[1, 0],
            [r["mean_distance_px"] for r in rows],
            [r["entropy_nats"] for r in rows],
            "mean attention distance (pixels)",
            "attention entropy (nats)",
        ),
    ]
    for ax, xs, ys, xlabel, ylabel in panels:
        for r, x, y in zip(rows, xs, ys, strict=True):
            ax.scatter(x, y, color=colours[r["layer"]], s=28)
            name = f"{r['layer']}:{r['head']}"
            ax.annotate(name, (x, y), fontsize=7, xytext=(3, 2), textcoords="offset points")
        ax.set_xlabel(xlabel, fontsize=9)
        ax.set_ylabel(ylabel, fontsize=9)
    for ax in (axes[0, 0], axes[0, 1]):
        ax.axvline(1.0, color="grey", lw=0.6, ls="--")
        ax.axhline(1.0, color="grey", lw=0.6, ls="--")
    drops = np.array([[100 * r[f"acc_drop_{c}"] for c in class_names] for r in rows])
    ax = axes[1, 1]
    image = ax.imshow(drops, aspect="auto", cmap="Reds", vmin=min(0.0, float(drops.min())))
    ax.set_xticks(range(len(class_names)), class_names, fontsize=8)
    ax.set_yticks(range(len(rows)), [f"{r['layer']}:{r['head']}" for r in rows], fontsize=6)
    ax.set_xlabel("class", fontsize=9)
    ax.set_ylabel("head (layer:head)", fontsize=9)
    fig.colorbar(image, ax=ax, label="accuracy drop when zeroed (points)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def parts_figure(pixels: torch.Tensor, labels: Sequence[str], title: str):
    """What :func:`skeleton_points` finds on each image: the skeleton in white, stroke ends
    as red circles, curves as blue squares, over the dimmed digit.

    Args:
        pixels: (N, H, W) or (N, 1, H, W) float in [0, 1], ink bright; N up to about 20.
        labels: N texts shown above the images.

    Returns:
        A matplotlib figure.
    """
    from matplotlib.figure import Figure

    pixels = pixels.reshape(pixels.shape[0], *pixels.shape[-2:]).float().cpu().numpy()
    columns = min(10, len(pixels))
    rows = -(-len(pixels) // columns)
    fig = Figure(figsize=(1.5 * columns, 1.6 * rows + 0.4), dpi=100)
    axes = fig.subplots(rows, columns, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, image, label in zip(axes.flat, pixels, labels, strict=False):
        ink = image >= INK_THRESHOLD
        ends, curves = skeleton_points(ink)
        picture = np.stack([0.35 * image.clip(0, 1)] * 3, axis=-1)
        picture[skeletonize(ink)] = 0.9
        ax.imshow(picture)
        for marks, style in (
            (ends, dict(marker="o", mec="red")),
            (curves, dict(marker="s", mec="deepskyblue")),
        ):
            r, c = np.nonzero(marks)
            ax.plot(c, r, ls="none", ms=5, mfc="none", mew=1.5, **style)
        ax.set_title(label, fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig
