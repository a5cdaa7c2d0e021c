"""Predict digits in a person's own images (PNG, JPEG, BMP, WebP; any size) with a trained
checkpoint: files, folders and glob patterns in; per image an attention picture (heads,
rollout, class relevance), and one ``predictions.csv`` for all of them, out."""

from __future__ import annotations

import glob
import logging
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from PIL import Image, ImageOps, UnidentifiedImageError
from torchvision.transforms.v2 import functional as TF

from vit_mnist.analysis.attention import attention_report, attention_rollout, cls_attention
from vit_mnist.checkpointing import read_checkpoint, resolve_ckpt_path
from vit_mnist.drawing import grey, labelled_grid, overlay
from vit_mnist.errors import CheckpointError, ConfigError, exit_on_user_error
from vit_mnist.io import save_png, write_csv
from vit_mnist.module import RUN_INFO_KEY, ViTClassifier
from vit_mnist.settings import PredictSettings, check_settings

log = logging.getLogger(__name__)

MNIST_BOX = 20  # pixels: MNIST digits fit a 20 x 20 box...
MNIST_SIZE = 28  # ...centred by centre of mass in a 28 x 28 image,
MNIST_CENTRE = 14.0  # at this row and column index.
# What reading one image can raise that means a bad file, not a bug: besides OSError, PIL
# raises SyntaxError and EOFError for some malformed files (APNG frames, a JPEG's MP index)
# and DecompressionBombError beyond twice its pixel limit; mnist_preprocess ValueError.
UNREADABLE = (
    OSError,
    SyntaxError,
    EOFError,
    ValueError,
    UnidentifiedImageError,
    Image.DecompressionBombError,
)

# What a folder or a pattern contributes: the suffixes PIL decodes in every install.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
GLOB_CHARS = frozenset("*?[")
# Images per forward pass: the attention weights of a batch take
# batch x depth x heads x tokens^2 floats (256 x 6 x 4 x 50^2 x 4 bytes = 60 MB with
# 4-pixel patches), so 10 000 images in one pass would need gigabytes.
BATCH_SIZE = 256
# Up to this many images the terminal gets one line each; beyond, a summary and the CSV.
LIST_AT_MOST = 20
CSV_NAME = "predictions.csv"
CSV_COLUMNS = ("path", "predicted", "confidence", "top3", "error", "attention")


def mnist_preprocess(image: Image.Image, ink_threshold: float = 0.1) -> torch.Tensor:
    """Turn a photo or scan of one digit into an MNIST-style image.

    Follows how MNIST was made (LeCun et al., the MNIST database page): grey levels,
    white ink on black (inverted when the background is light, judged from the border
    pixels), cropped to the digit, scaled with anti-aliasing to fit a 20 x 20 box keeping
    the aspect ratio, and pasted into 28 x 28 so that its centre of mass is at the centre.

    A phone photo's EXIF orientation is applied first (the pixels are stored sideways), and
    16-bit or 32-bit grey images are scaled to [0, 1] by their bit depth rather than
    clipped at 255 as ``convert("L")`` would.

    Args:
        image: any PIL image (RGB, RGBA, grey of 8, 16 or 32 bits, palette; any size).
        ink_threshold: fraction of the darkest-to-brightest range above which a pixel
            counts as ink when cropping.

    Returns:
        (1, 28, 28) float32 in [0, 1], 1 = ink.

    Raises:
        ValueError: the image holds no ink (a blank page).
    """
    image = ImageOps.exif_transpose(image)
    if image.mode in ("RGBA", "LA", "P"):
        # Transparent pixels become white paper, not black.
        background = Image.new("RGBA", image.size, "white")
        image = Image.alpha_composite(background, image.convert("RGBA"))
    if image.mode.startswith("I;16"):
        a = np.asarray(image, dtype=np.float32) / 65535.0
    elif image.mode in ("I", "F"):
        # 32-bit integer or float grey: 16-bit PNGs often load as "I". Scale by the
        # smallest bit depth that holds the values.
        a = np.asarray(image, dtype=np.float32)
        top = float(a.max())
        a = a / (1.0 if top <= 1.0 else 255.0 if top <= 255 else 65535.0 if top <= 65535 else top)
        a = np.clip(a, 0.0, 1.0)
    else:
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
    """One image's result: ``top`` holds (class name, probability) pairs, best first.

    ``error`` is set (and ``top`` empty, ``picture`` None) when the file could not be
    found or decoded.
    """

    path: Path
    top: list[tuple[str, float]]
    picture: Path | None = None
    error: str | None = None


def _keep_images(candidates: Iterable[Path], origin: str, hint: str | None = None) -> list[Path]:
    """The image files among ``candidates``, sorted; one log line on what was left out.

    Args:
        candidates: files and folders (a folder's entries, or a pattern's matches).
        origin: the ``images=`` value they came from, for the log line.
        hint: how to reach the subfolders; None: subfolders are not mentioned.
    """
    images: list[Path] = []
    skipped: Counter[str] = Counter()
    folders = 0
    for path in sorted(candidates):
        if path.is_dir():
            folders += 1
        elif path.name.startswith("."):
            # Left out as glob's "*" leaves them out: "._7.png" is the metadata macOS
            # writes beside "7.png" on a USB stick, not an image.
            skipped["hidden"] += 1
        elif path.suffix.lower() in IMAGE_SUFFIXES:
            images.append(path)
        else:
            skipped[path.suffix.lower() or "no suffix"] += 1
    parts = []
    if skipped:
        kinds = ", ".join(k if n == 1 else f"{k} x{n}" for k, n in sorted(skipped.items()))
        n = sum(skipped.values())
        parts.append(f"{n} file{'s' * (n != 1)} not PNG/JPEG/BMP/WebP ({kinds})")
    if folders and hint is not None:
        parts.append(f"{folders} subfolder{'s' * (folders != 1)} ({hint})")
    if parts:
        log.info("%s: skipped %s", origin, " and ".join(parts))
    return images


def collect_images(
    specs: str | Path | Iterable[str | Path],
) -> tuple[list[Path], list[tuple[str, str]]]:
    """The image files that ``images=`` names: files, folders and glob patterns.

    Each value is read as the first of these that applies:

    * an existing file: taken as is, whatever its suffix (one that is not an image is
      then reported by name when it fails to decode);
    * an existing folder: its files ending in .png, .jpg, .jpeg, .bmp or .webp (any
      case), sorted by name. Not recursive: subfolders are not searched (a pattern
      with ``**`` does that). Other files, hidden files and subfolders are skipped, with
      one log line per folder saying how many and which suffixes;
    * a pattern (it holds ``*``, ``?`` or ``[``), expanded by :func:`glob.glob` with
      ``**`` matching any depth of folders: the image files it matches, sorted, then the
      images directly inside the folders it matches. A matched file that is not an
      image is skipped (logged as for a folder): the pattern chose it, not the user.

    A leading ``~`` is the home folder; relative paths are taken from the current
    directory. A file reached twice (``a.png`` and ``./a.png``, or by a folder and a
    pattern) is kept once, at its first place.

    Args:
        specs: one value or a list of them (a Hydra ``ListConfig`` too); non-strings
            (Hydra reads ``images=7`` as an int) are taken as their text.

    Returns:
        ``(paths, problems)``: the files in order; and ``(value, reason)`` for each value
        that gave no image: a path that does not exist, a pattern that matches nothing,
        a folder or pattern with no image among its files, a folder that cannot be
        listed. Nothing is raised for such values: the caller decides.
    """
    if isinstance(specs, (str, Path)):
        specs = [specs]
    paths: list[Path] = []
    seen: set[Path] = set()
    problems: list[tuple[str, str]] = []
    for spec in map(str, specs):
        target = Path(os.path.expanduser(spec))
        if target.is_file():
            found = [target]
        elif target.is_dir():
            try:
                entries = list(target.iterdir())
            except OSError as e:  # no permission to list it, say: that value fails alone
                problems.append((spec, f"the folder cannot be listed ({e.strerror or e})"))
                continue
            found = _keep_images(
                entries,
                spec,
                f"not searched; images='{(target / '**' / '*.png').as_posix()}' would",
            )
            if not found:
                problems.append((spec, "the folder holds no PNG/JPEG/BMP/WebP file"))
        elif GLOB_CHARS & set(spec):
            matches = [Path(m) for m in sorted(glob.glob(str(target), recursive=True))]
            found = _keep_images((m for m in matches if not m.is_dir()), spec)
            for folder in (m for m in matches if m.is_dir()):
                # A matched folder that cannot be listed adds nothing; the pattern's
                # other matches still count.
                try:
                    found += _keep_images(list(folder.iterdir()), str(folder))
                except OSError as e:
                    log.warning("%s: cannot be listed (%s)", folder, e.strerror or e)
            if not matches:
                problems.append((spec, "no file matches this pattern"))
            elif not found:
                problems.append((spec, "the pattern matches no PNG/JPEG/BMP/WebP file"))
        else:
            problems.append((spec, "no such file or folder"))
            found = []
        for path in found:
            key = path.resolve()
            if key not in seen:
                seen.add(key)
                paths.append(path)
    return paths, problems


def output_stems(paths: Sequence[Path]) -> list[str]:
    """A distinct file-name stem per path, for its ``<stem>_28x28.png`` and
    ``<stem>_attention.png``.

    A path's own stem when no other path has it; when stems collide (``a/7.png`` and
    ``b/7.png``, or ``7.png`` and ``7.jpg``) the parent folder's name is put in front
    (``a_7``), and a number after when that still collides (``7_2``). Compared without
    case, as the files may land on a case-insensitive disk.
    """
    counts = Counter(p.stem.casefold() for p in paths)
    used: set[str] = set()
    stems = []
    for path in paths:
        base = path.stem
        if counts[base.casefold()] > 1:
            base = f"{path.resolve().parent.name or 'root'}_{base}"
        stem, n = base, 1
        while stem.casefold() in used:
            n += 1
            stem = f"{base}_{n}"
        used.add(stem.casefold())
        stems.append(stem)
    return stems


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
    batch_size: int = BATCH_SIZE,
) -> list[Prediction]:
    """Predict every image; save the 28 x 28 input and its attention picture per image.

    For ``<stem>.png`` it writes ``<out_dir>/<stem>_28x28.png`` (the model's input, white
    ink on black) and ``<out_dir>/<stem>_attention.png`` (the input, then the CLS attention
    of each head of the last layer, the rollout, and the class relevance map of the
    predicted class, Chefer et al. 2021, labelled ``relevance: <class>``); stems that two
    paths share are made distinct by :func:`output_stems`. The images are read and
    predicted ``batch_size`` at a time, so memory does not grow with their number; the
    relevance maps take one forward and backward pass per batch (gradients with respect
    to the attention weights only, despite the ``no_grad`` around the rest).

    Args:
        module: a trained :class:`ViTClassifier`.
        paths: image files; one that is missing or cannot be decoded gets ``error`` set
            and the others are still predicted.
        out_dir: the folder for the pictures (made when missing).
        mean, std: the normalisation the model was trained with.
        class_names: names of the classes, by index; default ``"0"``, ``"1"``, ...
        top_k: how many classes each :class:`Prediction` lists.
        batch_size: images per forward pass.

    Returns:
        One :class:`Prediction` per path, in order.
    """
    paths = [Path(p) for p in paths]
    stems = output_stems(paths)
    results: list[Prediction] = []
    for start in range(0, len(paths), batch_size):
        end = start + batch_size
        results += _predict_batch(
            module,
            paths[start:end],
            stems[start:end],
            Path(out_dir),
            mean=mean,
            std=std,
            class_names=class_names,
            top_k=top_k,
        )
        if len(paths) > batch_size:
            log.info("predicted %d of %d images", len(results), len(paths))
    return results


def _predict_batch(
    module: ViTClassifier,
    paths: Sequence[Path],
    stems: Sequence[str],
    out_dir: Path,
    *,
    mean: float,
    std: float,
    class_names: Sequence[str] | None,
    top_k: int,
) -> list[Prediction]:
    """:func:`predict_images` on one batch, the pictures named by ``stems``."""
    results: list[Prediction] = []
    inputs: list[torch.Tensor] = []
    good_stems: list[str] = []
    for path, stem in zip(paths, stems, strict=True):
        try:
            with Image.open(path) as image:
                image.load()
                inputs.append(mnist_preprocess(image))
            results.append(Prediction(path=path, top=[]))
            good_stems.append(stem)
        except UNREADABLE as e:
            results.append(Prediction(path=path, top=[], error=f"{type(e).__name__}: {e}"))
    good = [r for r in results if r.error is None]
    if not good:
        return results
    x = torch.stack(inputs)  # (N, 1, 28, 28) in [0, 1]
    model = module.net
    report = attention_report(model, (x - mean) / std)  # relevance of the predicted classes
    probs = report.logits.softmax(dim=1)
    names = list(class_names or map(str, range(probs.shape[1])))
    grid = model.patch_embed.grid_size
    last = cls_attention(report.weights[-1], grid)  # (N, heads, g, g)
    rollout = cls_attention(attention_rollout(report.weights), grid)  # (N, g, g)
    explained = report.logits.argmax(dim=1).tolist()  # the classes report.relevance explains
    heads = last.shape[1]
    out_dir.mkdir(parents=True, exist_ok=True)
    for i, (result, stem) in enumerate(zip(good, good_stems, strict=True)):
        p, c = probs[i].topk(min(top_k, probs.shape[1]))
        result.top = [(names[j], float(q)) for j, q in zip(c.tolist(), p.tolist(), strict=True)]
        image = x[i : i + 1]
        tiles = torch.cat(
            [
                grey(image),
                overlay(image.expand(heads, -1, -1, -1), last[i]),
                overlay(image, rollout[i : i + 1]),
                overlay(image, report.relevance[i : i + 1]),
            ]
        )[None]
        best, confidence = result.top[0]
        picture = labelled_grid(
            tiles,
            row_labels=[""],
            col_labels=["input", *(f"head {h}" for h in range(heads)), "rollout"]
            + [f"relevance: {names[explained[i]]}"],
            title=f"{result.path.name}: {best} ({100 * confidence:.1f}%), last layer",
        )
        save_png((grey(image)[0] * 255).round().to(torch.uint8), out_dir / f"{stem}_28x28.png")
        result.picture = out_dir / f"{stem}_attention.png"
        save_png(picture, result.picture)
    return results


def write_predictions_csv(results: Sequence[Prediction], path: str | Path) -> Path:
    """Write one CSV row per result, atomically (no half-written file after a crash).

    Columns: ``path`` (as given or found), ``predicted`` (the best class),
    ``confidence`` (its softmax probability, 0 to 1), ``top3`` (``"7:0.981 1:0.012
    9:0.003"``: class:probability, best first), ``error`` (empty when fine) and
    ``attention`` (the file name of the attention picture, in the same folder). A failed
    file has empty ``predicted``, ``confidence``, ``top3`` and ``attention``.

    Returns:
        ``path``, as a :class:`Path`.
    """
    rows = []
    for r in results:
        best = r.top[0] if r.top else ("", None)
        values = [
            str(r.path),
            best[0],
            "" if best[1] is None else f"{best[1]:.4f}",
            " ".join(f"{name}:{p:.3f}" for name, p in r.top),
            r.error or "",
            r.picture.name if r.picture else "",
        ]
        rows.append(dict(zip(CSV_COLUMNS, values, strict=True)))
    path = Path(path)
    write_csv(path, rows, CSV_COLUMNS)
    return path


@exit_on_user_error
def main(cfg: DictConfig) -> list[Prediction]:
    """The body of ``python scripts/predict.py ckpt_path=PATH images=...``.

    ``images`` is a file, a folder or a glob pattern, or a list of them (see
    :func:`collect_images`). Writes the pictures and ``predictions.csv`` into the run dir
    and prints one line per image, or for more than :data:`LIST_AT_MOST` images a
    summary; a file that fails gets its own line either way.

    Returns:
        One :class:`Prediction` per image, then one per ``images`` value that found no
        file (its ``path`` is the value).

    Raises:
        CheckpointError: no or an unreadable checkpoint (exit status 2).
        ConfigError: ``images`` missing, or naming no image at all (exit status 2).
        SystemExit(1): some files failed; the others were predicted and all are in the CSV.
    """
    if OmegaConf.is_missing(cfg, "ckpt_path"):
        raise CheckpointError(
            "ckpt_path is required: scripts/predict.py ckpt_path=PATH images=[a.png]"
        )
    if OmegaConf.is_missing(cfg, "images") or not cfg.images:
        raise ConfigError(
            "images is required: scripts/predict.py ckpt_path=PATH images=[a.png,b.jpg] "
            "(or images=my_digits/ for a folder)"
        )
    check_settings(cfg, PredictSettings)
    specs = list(cfg.images) if isinstance(cfg.images, ListConfig) else [cfg.images]
    # The checkpoint first: a wrong ckpt_path is reported even when images are wrong too.
    module, data = load_model(resolve_ckpt_path(cfg))
    paths, problems = collect_images(specs)
    if not paths:
        found_nothing = "; ".join(f"{spec}: {reason}" for spec, reason in problems)
        raise ConfigError(
            f"images names no image: {found_nothing}; give files, folders of "
            "PNG/JPEG/BMP/WebP images or patterns, e.g. images=my_digits/ or "
            "images=[a.png,scans/7.jpg] or \"images='scans/**/*.png'\""
        )
    out_dir = Path(cfg.paths.output_dir)
    results = predict_images(
        module,
        paths,
        out_dir,
        mean=data.get("mean", 0.1307),
        std=data.get("std", 0.3081),
    )
    results += [Prediction(path=Path(spec), top=[], error=reason) for spec, reason in problems]
    csv_path = write_predictions_csv(results, out_dir / CSV_NAME)
    failed = [r for r in results if r.error]
    for r in results:
        if r.error:
            print(f"{r.path}: cannot be read ({r.error})")
        elif len(results) <= LIST_AT_MOST:
            top = "  ".join(f"{name} ({100 * p:.1f}%)" for name, p in r.top)
            print(f"{r.path}: {top}   -> {r.picture}")
    if len(results) > LIST_AT_MOST:
        ok = len(results) - len(failed)
        counts = Counter(r.top[0][0] for r in results if r.top)
        classes = ", ".join(f"{name}: {n}" for name, n in sorted(counts.items()))
        print(
            f"{ok} of {len(results)} images predicted (classes {classes}); "
            f"attention pictures in {out_dir}"
        )
    print(f"predictions: {csv_path}" + (f" ({len(failed)} failed)" if failed else ""))
    if failed:
        raise SystemExit(1)
    return results
