"""Predict digits in a person's own images (PNG, JPEG, BMP, WebP; any size) with a trained
checkpoint: files, folders and glob patterns in; ``predictions.csv``, grown batch by batch
so that an interrupted run keeps what it did, and an attention picture (heads, rollout,
class relevance) for the first ``pictures`` images, out."""

from __future__ import annotations

import csv
import errno
import glob
import io
import logging
import os
import shlex
import signal
import stat
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from PIL import Image, ImageOps, UnidentifiedImageError
from torchvision.transforms.v2 import functional as TF

from vit_mnist.analysis.attention import attention_rollout, cls_attention
from vit_mnist.analysis.relevance import class_relevance
from vit_mnist.checkpointing import read_checkpoint, resolve_ckpt_path
from vit_mnist.drawing import grey, labelled_grid, overlay
from vit_mnist.errors import CheckpointError, ConfigError, exit_on_user_error
from vit_mnist.io import append_csv_rows, printable_path, save_png
from vit_mnist.models.vit import VisionTransformer
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
# Images per forward pass and per flush of predictions.csv: the attention weights of a
# batch take batch x depth x heads x tokens^2 floats (256 x 6 x 4 x 50^2 x 4 bytes = 60 MB
# with 4-pixel patches), so 10 000 images in one pass would need gigabytes.
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


def file_kind(path: Path) -> str:
    """``"file"``, ``"folder"``, or why ``path`` is neither and must be skipped.

    The reasons: a symlink loop, a dangling link (and where it points), a special file
    (FIFO, socket, device: opening a FIFO would wait for a writer forever), ``"no such
    file or folder"``, or what ``stat`` says (no permission to reach it, say). Never
    raises.
    """
    try:
        mode = path.stat().st_mode  # follows links
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop"
        if isinstance(e, FileNotFoundError):
            if not path.is_symlink():
                return "no such file or folder"
            try:
                return f"a dangling link (to {os.readlink(path)})"
            except OSError:
                return "a dangling link"
        return f"cannot be reached ({e.strerror or e})"
    except ValueError as e:  # a name the OS cannot take (a NUL byte)
        return f"not a usable path ({e})"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISREG(mode):
        return "file"
    what = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"{what}, not an image file"


def _keep_images(candidates: Iterable[Path], origin: str, hint: str | None = None) -> list[Path]:
    """The image files among ``candidates``, sorted; one log line on what was left out.

    Symlink loops, dangling links and special files (FIFOs, sockets, devices) get one
    warning line each, naming them, and are skipped.

    Args:
        candidates: files and folders (a folder's entries, or a pattern's matches).
        origin: the ``images=`` value they came from, for the log line.
        hint: how to reach the subfolders; None: subfolders are not mentioned.
    """
    images: list[Path] = []
    skipped: Counter[str] = Counter()
    folders = 0
    for path in sorted(candidates):
        kind = file_kind(path)
        if kind == "folder":
            folders += 1
        elif kind != "file":
            log.warning("%s: %s; skipped", printable_path(path), kind)
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


def _pattern_root(pattern: str) -> Path:
    """The folder a pattern starts in: its leading parts that hold no glob character."""
    parts = Path(pattern).parts
    first = next((i for i, part in enumerate(parts) if GLOB_CHARS & set(part)), len(parts))
    return Path(*parts[:first]) if first else Path(".")


def _unsafe_folders(pattern: str) -> list[Path]:
    """For a ``**`` pattern: the folders under its root that :func:`glob.glob` would walk
    into without a word, each named in one warning line.

    A subfolder that cannot be listed is skipped by glob in silence; a link to a folder
    that holds it (``loop -> ..``) is followed by glob again and again, some 40 levels
    deep. Returns the loops, whose matches the caller drops.
    """
    loops: list[Path] = []

    def unlisted(error: OSError) -> None:
        log.warning(
            "%s: a subfolder that cannot be listed (%s); skipped",
            printable_path(error.filename),
            error.strerror or error,
        )

    for folder, subfolders, files in os.walk(_pattern_root(pattern), onerror=unlisted):
        here = os.path.realpath(folder)
        for name in subfolders + files:
            path = Path(folder, name)
            if not path.is_symlink():
                continue
            target = os.path.realpath(path)
            if file_kind(path) == "folder" and (here + os.sep).startswith(target + os.sep):
                shown = printable_path(path), printable_path(target)
                log.warning("%s: a symlink loop (to %s, which holds it); skipped", *shown)
                loops.append(path)
    return loops


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

    Nothing on the way stops the walk: symlink loops, dangling links, special files
    (FIFOs, sockets, devices) and subfolders that cannot be listed are named in one
    warning line each and skipped (:func:`file_kind`); the rest is collected.

    A leading ``~`` is the home folder; relative paths are taken from the current
    directory. A file reached twice (``a.png`` and ``./a.png``, or by a folder and a
    pattern) is kept once, at its first place.

    Args:
        specs: one value or a list of them (a Hydra ``ListConfig`` too); non-strings
            (Hydra reads ``images=7`` as an int) are taken as their text.

    Returns:
        ``(paths, problems)``: the files in order; and ``(value, reason)`` for each value
        that gave no image: a path that does not exist, is a loop, a dangling link or a
        special file, a pattern that matches nothing, a folder or pattern with no image
        among its files, a folder that cannot be listed. Nothing is raised for such
        values: the caller decides.
    """
    if isinstance(specs, (str, Path)):
        specs = [specs]
    paths: list[Path] = []
    seen: set[str] = set()
    problems: list[tuple[str, str]] = []
    for spec in map(str, specs):
        target = Path(os.path.expanduser(spec))
        kind = file_kind(target)
        if kind == "file":
            found = [target]
        elif kind == "folder":
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
            loops = _unsafe_folders(str(target)) if "**" in spec else []
            inside = tuple(f"{loop}{os.sep}" for loop in loops)
            matches = [
                Path(m)
                for m in sorted(glob.glob(str(target), recursive=True))
                if not m.startswith(inside) or not inside
            ]
            found = _keep_images((m for m in matches if file_kind(m) != "folder"), spec)
            for folder in (m for m in matches if file_kind(m) == "folder"):
                # A matched folder that cannot be listed adds nothing; the pattern's
                # other matches still count.
                try:
                    found += _keep_images(list(folder.iterdir()), str(folder))
                except OSError as e:
                    shown = printable_path(folder)
                    log.warning("%s: cannot be listed (%s)", shown, e.strerror or e)
            if not matches:
                problems.append((spec, "no file matches this pattern"))
            elif not found:
                problems.append((spec, "the pattern matches no PNG/JPEG/BMP/WebP file"))
        else:
            problems.append((spec, kind))
            found = []
        for path in found:
            # realpath, not Path.resolve: it does not raise on a symlink loop.
            key = os.path.realpath(path)
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
    counts = Counter(printable_path(p.stem).casefold() for p in paths)
    used: set[str] = set()
    stems = []
    for path in paths:
        base = printable_path(path.stem)
        if counts[base.casefold()] > 1:
            base = f"{printable_path(path.resolve().parent.name) or 'root'}_{base}"
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


def iter_predictions(
    module: ViTClassifier,
    paths: Sequence[str | Path],
    out_dir: str | Path,
    *,
    pictures: int | None = None,
    stems: Sequence[str] | None = None,
    mean: float = 0.1307,
    std: float = 0.3081,
    class_names: Sequence[str] | None = None,
    top_k: int = 3,
    batch_size: int = BATCH_SIZE,
) -> Iterator[list[Prediction]]:
    """Predict the images ``batch_size`` at a time, yielding each batch's results.

    Every image gets its top classes from one plain forward pass per batch. The first
    ``pictures`` of ``paths`` also get ``<out_dir>/<stem>_28x28.png`` (the model's input,
    white ink on black) and ``<out_dir>/<stem>_attention.png`` (the input, then the CLS
    attention of each head of the last layer, the rollout, and the class relevance map of
    the predicted class, Chefer et al. 2021, labelled ``relevance: <class>``): for those,
    one more forward pass through the explicit attention path and one backward pass (the
    gradients with respect to the attention weights only) per batch, and the tiles of all
    of them coloured at once. Memory does not grow with the number of images.

    Args:
        module: a trained :class:`ViTClassifier`.
        paths: image files; one that is missing or cannot be decoded gets ``error`` set
            and the others are still predicted. An animated image (GIF, APNG, WebP) is
            predicted from its first frame, with a warning line naming it.
        out_dir: the folder for the pictures (made when one is drawn).
        pictures: how many of the first ``paths`` get pictures; None: all of them.
        stems: the pictures' file-name stems, one per path; default
            :func:`output_stems` of ``paths``.
        mean, std: the normalisation the model was trained with.
        class_names: names of the classes, by index; default ``"0"``, ``"1"``, ...
        top_k: how many classes each :class:`Prediction` lists.
        batch_size: images per forward pass.

    Yields:
        A list of :class:`Prediction` per batch, in the order of ``paths``.
    """
    paths = [Path(p) for p in paths]
    stems = list(stems) if stems is not None else output_stems(paths)
    limit = len(paths) if pictures is None else pictures
    done = 0
    for start in range(0, len(paths), batch_size):
        end = start + batch_size
        batch = _predict_batch(
            module,
            paths[start:end],
            stems[start:end],
            Path(out_dir),
            draw=max(0, min(end, limit) - start),
            mean=mean,
            std=std,
            class_names=class_names,
            top_k=top_k,
        )
        done += len(batch)
        if len(paths) > batch_size:
            log.info("predicted %d of %d images", done, len(paths))
        yield batch


def predict_images(
    module: ViTClassifier, paths: Sequence[str | Path], out_dir: str | Path, **options: Any
) -> list[Prediction]:
    """:func:`iter_predictions` gathered into one list: one :class:`Prediction` per path,
    in order. ``options`` are those of :func:`iter_predictions` (every image gets its
    pictures unless ``pictures`` says otherwise)."""
    return list(chain.from_iterable(iter_predictions(module, paths, out_dir, **options)))


def _read_image(path: Path) -> torch.Tensor:
    """:func:`mnist_preprocess` of the file at ``path``; a warning line when it is animated."""
    with Image.open(path) as image:
        image.load()
        frames = getattr(image, "n_frames", 1)
        if frames > 1:
            shown = printable_path(path)
            log.warning(
                "%s: an animation of %d frames; its first frame is predicted", shown, frames
            )
        return mnist_preprocess(image)


@torch.no_grad()
def _predict_batch(
    module: ViTClassifier,
    paths: Sequence[Path],
    stems: Sequence[str],
    out_dir: Path,
    *,
    draw: int,
    mean: float,
    std: float,
    class_names: Sequence[str] | None,
    top_k: int,
) -> list[Prediction]:
    """:func:`iter_predictions` on one batch; the first ``draw`` paths get pictures named
    by ``stems``."""
    results: list[Prediction] = []
    inputs: list[torch.Tensor] = []
    drawn: list[int] = []  # indices into inputs of the images that get pictures
    for index, path in enumerate(paths):
        try:
            inputs.append(_read_image(path))
        except UNREADABLE as e:
            results.append(Prediction(path=path, top=[], error=f"{type(e).__name__}: {e}"))
            continue
        if index < draw:
            drawn.append(len(inputs) - 1)
        results.append(Prediction(path=path, top=[]))
    good = [r for r in results if r.error is None]
    if not good:
        return results
    x = torch.stack(inputs)  # (N, 1, 28, 28) in [0, 1]
    model = module.net
    probs = model((x - mean) / std).float().softmax(dim=1)  # (N, classes)
    names = list(class_names or map(str, range(probs.shape[1])))
    p, c = probs.topk(min(top_k, probs.shape[1]), dim=1)
    for result, classes, chances in zip(good, c.tolist(), p.tolist(), strict=True):
        result.top = [(names[j], q) for j, q in zip(classes, chances, strict=True)]
    if drawn:
        stem_of = {id(r): stem for r, stem in zip(results, stems, strict=True)}
        pictured = [good[i] for i in drawn]
        classes = probs.argmax(dim=1)[drawn]
        stems_drawn = [stem_of[id(r)] for r in pictured]
        _draw(model, x[drawn], classes, pictured, stems_drawn, out_dir, mean=mean, std=std)
    return results


def _draw(
    model: torch.nn.Module,
    x: torch.Tensor,
    classes: torch.Tensor,
    results: Sequence[Prediction],
    stems: Sequence[str],
    out_dir: Path,
    *,
    mean: float,
    std: float,
) -> None:
    """Write the two pictures of each image and set its result's ``picture``.

    Args:
        x: (P, 1, 28, 28) float32 in [0, 1], the model's inputs before normalisation.
        classes: (P,) int64, the predicted classes, whose relevance is drawn.
        results: the P predictions, ``top`` filled.
        stems: the P file-name stems.

    The maps of all P images are computed and coloured together. A model without attention
    (the convnet teacher) gets the input picture alone.
    """
    inputs = (grey(x) * 255).round().to(torch.uint8)  # (P, 3, 28, 28)
    if not isinstance(model, VisionTransformer):
        for i, stem in enumerate(stems):
            save_png(inputs[i], out_dir / f"{stem}_28x28.png")
        return
    _, weights = model.forward_with_attention((x - mean) / std)
    weights = [w.float().cpu() for w in weights]
    relevance, _ = class_relevance(model, (x - mean) / std, classes)  # (P, g, g)
    grid = model.patch_embed.grid_size
    last = cls_attention(weights[-1], grid)  # (P, heads, g, g)
    rollout = cls_attention(attention_rollout(weights), grid)  # (P, g, g)
    n, heads = last.shape[:2]
    tiles = torch.cat(
        [
            grey(x)[:, None],
            overlay(x.repeat_interleave(heads, 0), last.flatten(0, 1)).unflatten(0, (n, heads)),
            overlay(x, rollout)[:, None],
            overlay(x, relevance)[:, None],
        ],
        dim=1,
    )  # (P, heads + 3, 3, 28, 28)
    col_labels = ["input", *(f"head {h}" for h in range(heads)), "rollout"]
    for i, (result, stem) in enumerate(zip(results, stems, strict=True)):
        best, confidence = result.top[0]
        name = printable_path(result.path.name)
        picture = labelled_grid(
            tiles[i : i + 1],
            row_labels=[""],
            col_labels=[*col_labels, f"relevance: {best}"],
            title=f"{name}: {best} ({100 * confidence:.1f}%), last layer",
        )
        save_png(inputs[i], out_dir / f"{stem}_28x28.png")
        result.picture = out_dir / f"{stem}_attention.png"
        save_png(picture, result.picture)


def csv_rows(results: Iterable[Prediction]) -> list[dict[str, str]]:
    """The ``predictions.csv`` rows of ``results``, one each.

    Columns: ``path`` (as given or found; a name's bytes that are not UTF-8 as ``\\xNN``,
    :func:`~vit_mnist.io.printable_path`), ``predicted`` (the best class),
    ``confidence`` (its softmax probability, 0 to 1), ``top3`` (``"7:0.981 1:0.012
    9:0.003"``: class:probability, best first), ``error`` (empty when fine) and
    ``attention`` (the file name of the attention picture, in the same folder; empty for
    an image beyond ``pictures``). A failed file has empty ``predicted``, ``confidence``,
    ``top3`` and ``attention``.
    """
    rows = []
    for r in results:
        best = r.top[0] if r.top else ("", None)
        values = [
            printable_path(r.path),
            best[0],
            "" if best[1] is None else f"{best[1]:.4f}",
            " ".join(f"{name}:{p:.3f}" for name, p in r.top),
            r.error or "",
            r.picture.name if r.picture else "",
        ]
        rows.append(dict(zip(CSV_COLUMNS, values, strict=True)))
    return rows


def read_done_rows(path: str | Path) -> dict[str, dict[str, str]]:
    """The rows of an earlier ``predictions.csv``, by their ``path`` value, to resume from.

    A last line without its newline (the process was killed while writing it: see
    :func:`vit_mnist.io.append_csv_rows`) is cut from the file, with a warning, so that
    its image is predicted again and the rows appended next start on a line of their own.

    Raises:
        ConfigError: the file's header is not :data:`CSV_COLUMNS` (not a file of this
            program).
    """
    path = Path(path)
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with path.open("r+b") as f:
            f.truncate(keep)
        log.warning("%s: its last line was cut off; that image is predicted again", path)
        data = data[:keep]
    reader = csv.DictReader(io.StringIO(data.decode("utf-8", "replace")))
    if data and tuple(reader.fieldnames or ()) != CSV_COLUMNS:
        raise ConfigError(
            f"{path} does not have the columns of a predictions.csv ({','.join(CSV_COLUMNS)}); "
            "choose another run dir (hydra.run.dir=PATH) or move the file away"
        )
    return {
        row["path"]: row
        for row in reader
        if None not in row and all(v is not None for v in row.values())
    }


class _Interrupts:
    """Ctrl-C and SIGTERM as :class:`KeyboardInterrupt`, held back while :meth:`held`, so a
    batch's rows are written and counted together or not at all."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._holding = False
        self._pending = False

    def handler(self, signum: int, frame: Any) -> None:
        self.signum = signum
        if self._holding:
            self._pending = True
            return
        raise KeyboardInterrupt

    @contextmanager
    def installed(self) -> Iterator[_Interrupts]:
        previous = {s: signal.signal(s, self.handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    @contextmanager
    def held(self) -> Iterator[None]:
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self._pending:
            self._pending = False
            raise KeyboardInterrupt


def _pictures_limit(value: Any, count: int) -> int:
    """``pictures=all`` or a number (the settings schema checks which) as a number."""
    return count if value == "all" else int(value)


@exit_on_user_error
def main(cfg: DictConfig) -> list[Prediction]:
    """The body of ``python scripts/predict.py ckpt_path=PATH images=...``.

    ``images`` is a file, a folder or a glob pattern, or a list of them (see
    :func:`collect_images`). Appends each batch's rows to ``predictions.csv`` in the run
    dir as soon as they are made, draws the pictures of the first ``pictures`` images
    (``all``, or 0 for none), and prints one line per image, or for more than
    :data:`LIST_AT_MOST` images a summary; a file that fails gets its own line either way.

    A run dir that holds a ``predictions.csv`` already (``hydra.run.dir`` of an earlier
    run) is refused unless ``resume=true``: then the files in its rows are skipped and
    the others predicted and appended. Ctrl-C or SIGTERM stops after the rows written so
    far, says how many and how to go on, and exits 130 or 143 (128 + the signal).

    Returns:
        One :class:`Prediction` per image predicted by this run, then one per ``images``
        value that found no file (its ``path`` is the value).

    Raises:
        CheckpointError: no or an unreadable checkpoint (exit status 2).
        ConfigError: ``images`` missing, or naming no image at all, or a
            ``predictions.csv`` in the run dir without ``resume=true`` (exit status 2).
        SystemExit(1): some files failed (in this run or, resumed, an earlier one); the
            others were predicted and all are in the CSV.
        SystemExit(130 or 143): interrupted; the finished rows are kept.
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
    out_dir = Path(cfg.paths.output_dir)
    csv_path = out_dir / CSV_NAME
    resume = bool(cfg.resume)
    if csv_path.exists() and not resume:
        raise ConfigError(
            f"{csv_path} exists already: add resume=true to predict only the files not in it, "
            "or leave hydra.run.dir out for a new run dir"
        )
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
    done = read_done_rows(csv_path) if csv_path.exists() else {}
    if resume:
        log.info(
            "resume=true: %d of the %d images are in %s already",
            sum(printable_path(p) in done for p in paths),
            len(paths),
            csv_path,
        )
    stems = output_stems(paths)
    todo = [i for i, path in enumerate(paths) if printable_path(path) not in done]
    limit = _pictures_limit(cfg.pictures, len(paths))
    results: list[Prediction] = []
    failed_before = sum(bool(row["error"]) for row in done.values())
    interrupts = _Interrupts()
    try:
        with interrupts.installed():
            batches = iter_predictions(
                module,
                [paths[i] for i in todo],
                out_dir,
                stems=[stems[i] for i in todo],
                pictures=sum(i < limit for i in todo),
                mean=data.get("mean", 0.1307),
                std=data.get("std", 0.3081),
                batch_size=BATCH_SIZE,
            )
            for batch in batches:
                with interrupts.held():
                    append_csv_rows(csv_path, csv_rows(batch), CSV_COLUMNS)
                    results += batch
            unfound = [
                Prediction(path=Path(spec), top=[], error=reason)
                for spec, reason in problems
                if printable_path(Path(spec)) not in done
            ]
            with interrupts.held():
                if unfound:
                    append_csv_rows(csv_path, csv_rows(unfound), CSV_COLUMNS)
                results += unfound
    except KeyboardInterrupt:
        kept = sum(printable_path(p) in done for p in paths) + len(results)
        what = "SIGTERM" if interrupts.signum == signal.SIGTERM else "Ctrl-C"
        print(
            f"\nInterrupted ({what}): {kept} of {len(paths)} images are in {csv_path}; "
            f"to predict the rest, run the same command with resume=true "
            f"{shlex.quote(f'hydra.run.dir={out_dir}')}",
            file=sys.stderr,
        )
        raise SystemExit(128 + (interrupts.signum or signal.SIGINT)) from None
    failed = [r for r in results if r.error]
    total = len(done) + len(results)
    for r in results:
        if r.error:
            print(f"{printable_path(r.path)}: cannot be read ({r.error})")
        elif total <= LIST_AT_MOST:
            top = "  ".join(f"{name} ({100 * p:.1f}%)" for name, p in r.top)
            picture = f"   -> {printable_path(r.picture)}" if r.picture else ""
            print(f"{printable_path(r.path)}: {top}{picture}")
    if total > LIST_AT_MOST:
        counts = Counter(r.top[0][0] for r in results if r.top)
        counts.update(row["predicted"] for row in done.values() if row["predicted"])
        classes = ", ".join(f"{name}: {n}" for name, n in sorted(counts.items()))
        drawn = sum(r.picture is not None for r in results)
        drawn += sum(bool(row["attention"]) for row in done.values())
        print(
            f"{total - len(failed) - failed_before} of {total} images predicted "
            f"(classes {classes}"
            + (f"; {len(done)} of them by the earlier run" if done else "")
            + f"); attention pictures of {drawn} in {out_dir}"
        )
    n_failed = len(failed) + failed_before
    print(f"predictions: {csv_path}" + (f" ({n_failed} failed)" if n_failed else ""))
    if n_failed:
        raise SystemExit(1)
    return results
