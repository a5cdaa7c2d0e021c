"""Predict digits in a person's own images (PNG, JPEG, any size) with a trained checkpoint."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from PIL import Image, UnidentifiedImageError
from torchvision.transforms.v2 import functional as TF

from vit_mnist.analysis.attention import attention_report, attention_rollout, cls_attention
from vit_mnist.checkpointing import read_checkpoint, resolve_ckpt_path
from vit_mnist.drawing import grey, labelled_grid, overlay
from vit_mnist.errors import CheckpointError, ConfigError, exit_on_user_error
from vit_mnist.io import save_png
from vit_mnist.module import RUN_INFO_KEY, ViTClassifier

log = logging.getLogger(__name__)

MNIST_BOX = 20  # pixels: MNIST digits fit a 20 x 20 box...
MNIST_SIZE = 28  # ...centred by centre of mass in a 28 x 28 image,
MNIST_CENTRE = 14.0  # at this row and column index.


def mnist_preprocess(image: Image.Image, ink_threshold: float = 0.1) -> torch.Tensor:
    """Turn a photo or scan of one digit into an MNIST-style image.

    Follows how MNIST was made (LeCun et al., the MNIST database page): grey levels,
    white ink on black (inverted when the background is light, judged from the border
    pixels), cropped to the digit, scaled with anti-aliasing to fit a 20 x 20 box keeping
    the aspect ratio, and pasted into 28 x 28 so that its centre of mass is at the centre.

    Args:
        image: any PIL image (RGB, RGBA, grey, palette; any size).
        ink_threshold: fraction of the darkest-to-brightest range above which a pixel
            counts as ink when cropping.

    Returns:
        (1, 28, 28) float32 in [0, 1], 1 = ink.

    Raises:
        ValueError: the image holds no ink (a blank page).
    """
    if image.mode in ("RGBA", "LA", "P"):
        # Transparent pixels become white paper, not black.
        background = Image.new("RGBA", image.size, "white")
        image = Image.alpha_composite(background, image.convert("RGBA"))
    a = np.asarray(image.convert("L"), dtype=np.float32) / 255.0
    border = np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]])
    if np.median(border) > 0.5:
        a = 1.0 - a
    paper = float(np.median(np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]])))
    a = np.clip(a - paper, 0.0, None)
    if a.max() <= 1e-6:
        raise ValueError("no digit found: the image is blank")
    a /= a.max()
    rows, cols = np.nonzero(a > ink_threshold)
    a = a[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
    h, w = a.shape
    scale = MNIST_BOX / max(h, w)
    new_h, new_w = max(1, round(h * scale)), max(1, round(w * scale))
    digit = TF.resize(torch.from_numpy(a)[None], [new_h, new_w], antialias=True)[0].clamp(0, 1)
    ys, xs = torch.meshgrid(torch.arange(new_h), torch.arange(new_w), indexing="ij")
    mass = digit.sum()
    cy, cx = float((ys * digit).sum() / mass), float((xs * digit).sum() / mass)
    # MNIST's centres of mass sit on pixel (14, 14) (the test set's mean is (13.99, 14.00)).
    top, left = round(MNIST_CENTRE - cy), round(MNIST_CENTRE - cx)
    out = torch.zeros(MNIST_SIZE, MNIST_SIZE)
    y0, x0 = max(0, top), max(0, left)
    y1, x1 = min(MNIST_SIZE, top + new_h), min(MNIST_SIZE, left + new_w)
    out[y0:y1, x0:x1] = digit[y0 - top : y1 - top, x0 - left : x1 - left]
    return out[None]


@dataclass
class Prediction:
    """One image's result: ``top`` holds (class name, probability) pairs, best first."""

    path: Path
    top: list[tuple[str, float]]
    picture: Path | None = None
    error: str | None = None


def load_model(ckpt_path: str | Path) -> tuple[ViTClassifier, dict[str, Any]]:
    """The model of a checkpoint, on the CPU in eval mode, and its stored data config.

    Raises:
        CheckpointError: see :func:`vit_mnist.evaluate.read_checkpoint`.
    """
    ckpt = read_checkpoint(ckpt_path)
    module = ViTClassifier.load_from_checkpoint(ckpt_path, map_location="cpu", weights_only=True)
    return module.eval(), ckpt.get(RUN_INFO_KEY, {}).get("data", {})


@torch.no_grad()
def predict_images(
    module: ViTClassifier,
    paths: Sequence[str | Path],
    out_dir: str | Path,
    *,
    mean: float = 0.1307,
    std: float = 0.3081,
    class_names: Sequence[str] | None = None,
    top_k: int = 3,
) -> list[Prediction]:
    """Predict every image; save the 28 x 28 input and its attention picture per image.

    For ``<stem>.png`` it writes ``<out_dir>/<stem>_28x28.png`` (the model's input, white
    ink on black) and ``<out_dir>/<stem>_attention.png`` (the input, then the CLS attention
    of each head of the last layer, then the rollout).

    Args:
        module: a trained :class:`ViTClassifier`.
        paths: image files; one that is missing or cannot be decoded gets ``error`` set
            and the others are still predicted.
        mean, std: the normalisation the model was trained with.

    Returns:
        One :class:`Prediction` per path, in order.
    """
    out_dir = Path(out_dir)
    results: list[Prediction] = []
    inputs: list[torch.Tensor] = []
    for path in map(Path, paths):
        try:
            with Image.open(path) as image:
                image.load()
                inputs.append(mnist_preprocess(image))
            results.append(Prediction(path=path, top=[]))
        except (OSError, UnidentifiedImageError, ValueError) as e:
            results.append(Prediction(path=path, top=[], error=f"{type(e).__name__}: {e}"))
    good = [r for r in results if r.error is None]
    if not good:
        return results
    x = torch.stack(inputs)  # (N, 1, 28, 28) in [0, 1]
    model = module.net
    report = attention_report(model, (x - mean) / std)
    probs = report.logits.softmax(dim=1)
    names = list(class_names or map(str, range(probs.shape[1])))
    grid = model.patch_embed.grid_size
    last = cls_attention(report.weights[-1], grid)  # (N, heads, g, g)
    rollout = cls_attention(attention_rollout(report.weights), grid)  # (N, g, g)
    heads = last.shape[1]
    out_dir.mkdir(parents=True, exist_ok=True)
    for i, result in enumerate(good):
        p, c = probs[i].topk(min(top_k, probs.shape[1]))
        result.top = [(names[j], float(q)) for j, q in zip(c.tolist(), p.tolist(), strict=True)]
        image = x[i : i + 1]
        tiles = torch.cat(
            [
                grey(image),
                overlay(image.expand(heads, -1, -1, -1), last[i]),
                overlay(image, rollout[i : i + 1]),
            ]
        )[None]
        best, confidence = result.top[0]
        picture = labelled_grid(
            tiles,
            row_labels=[""],
            col_labels=["input"] + [f"head {h}" for h in range(heads)] + ["rollout"],
            title=f"{result.path.name}: {best} ({100 * confidence:.1f}%), last layer",
        )
        stem = result.path.stem
        save_png((grey(image)[0] * 255).round().to(torch.uint8), out_dir / f"{stem}_28x28.png")
        result.picture = out_dir / f"{stem}_attention.png"
        save_png(picture, result.picture)
    return results


@exit_on_user_error
def main(cfg: DictConfig) -> list[Prediction]:
    """The body of ``python scripts/predict.py ckpt_path=PATH images=[a.png,b.jpg]``.

    Prints one line per image; exits 1 when any image could not be read (after the
    others were predicted).
    """
    if OmegaConf.is_missing(cfg, "ckpt_path"):
        raise CheckpointError(
            "ckpt_path is required: scripts/predict.py ckpt_path=PATH images=[a.png]"
        )
    if OmegaConf.is_missing(cfg, "images") or not cfg.images:
        raise ConfigError(
            "images is required: scripts/predict.py ckpt_path=PATH images=[a.png,b.jpg]"
        )
    images = [cfg.images] if isinstance(cfg.images, str) else list(cfg.images)
    module, data = load_model(resolve_ckpt_path(cfg))
    results = predict_images(
        module,
        images,
        cfg.paths.output_dir,
        mean=data.get("mean", 0.1307),
        std=data.get("std", 0.3081),
    )
    failed = 0
    for r in results:
        if r.error:
            failed += 1
            print(f"{r.path}: cannot be read ({r.error})")
        else:
            top = "  ".join(f"{name} ({100 * p:.1f}%)" for name, p in r.top)
            print(f"{r.path}: {top}   -> {r.picture}")
    if failed:
        raise SystemExit(1)
    return results
