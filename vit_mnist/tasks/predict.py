"""Predict digits in a person's own images (PNG, JPEG, BMP, WebP; any size) with a trained
checkpoint: files, folders and glob patterns in; ``predictions.csv``, grown batch by batch
so that an interrupted run keeps what it did, and an attention picture (heads, rollout,
class relevance) for the first ``pictures`` images, out."""

from __future__ import annotations

import csv
import io
import logging
import os
import shlex
import signal
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from vit_mnist.analysis.attention import attention_rollout, cls_attention
from vit_mnist.analysis.drawing import grey, labelled_grid, overlay
from vit_mnist.analysis.pruning import speed_and_size
from vit_mnist.analysis.relevance import class_relevance
from vit_mnist.data.images import UNREADABLE, collect_images, read_image
from vit_mnist.errors import CheckpointError, ConfigError, exit_on_user_error
from vit_mnist.io import append_csv_rows, printable_path, save_png
from vit_mnist.models import build_model
from vit_mnist.models.vit import VisionTransformer
from vit_mnist.settings import PredictSettings, check_settings
from vit_mnist.training.checkpointing import load_model, resolve_ckpt_path
from vit_mnist.training.module import ViTClassifier

log = logging.getLogger(__name__)

# Images per forward pass and per flush of predictions.csv: the attention weights of a
# batch take batch x depth x heads x tokens^2 floats (256 x 6 x 4 x 50^2 x 4 bytes = 60 MB
# with 4-pixel patches), so 10 000 images in one pass would need gigabytes.
BATCH_SIZE = 256
# Up to this many images the terminal gets one line each; beyond, a summary and the CSV.
LIST_AT_MOST = 20
CSV_NAME = "predictions.csv"
CSV_COLUMNS = ("path", "predicted", "confidence", "top3", "error", "attention")


@dataclass
class Prediction:
    """One image's result: ``top`` holds (class name, probability) pairs, best first.

    ``error`` is set (and ``top`` empty, ``picture`` None) when the file could not be
    found or decoded.
    """

    path: Path
    top: list[tuple[str, float]] = field(default_factory=list)
    picture: Path | None = None
    error: str | None = None


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
        if len(paths) > batch_size:
            log.info("predicted %d of %d images", min(end, len(paths)), len(paths))
        yield batch


def predict_images(
    module: ViTClassifier, paths: Sequence[str | Path], out_dir: str | Path, **options: Any
) -> list[Prediction]:
    """:func:`iter_predictions` gathered into one list: one :class:`Prediction` per path,
    in order. ``options`` are those of :func:`iter_predictions` (every image gets its
    pictures unless ``pictures`` says otherwise)."""
    return list(chain.from_iterable(iter_predictions(module, paths, out_dir, **options)))


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
    results = [Prediction(path=path) for path in paths]
    inputs, good = [], []  # the images read, and their indices in results
    for i, result in enumerate(results):
        try:
            inputs.append(read_image(result.path))
            good.append(i)
        except UNREADABLE as e:
            result.error = f"{type(e).__name__}: {e}"
    if not good:
        return results
    x = torch.stack(inputs)  # (N, 1, 28, 28) in [0, 1]
    z = (x - mean) / std
    probs = module.net(z).float().softmax(dim=1)  # (N, classes)
    names = list(class_names or map(str, range(probs.shape[1])))
    p, c = probs.topk(min(top_k, probs.shape[1]), dim=1)
    for i, classes, chances in zip(good, c.tolist(), p.tolist(), strict=True):
        results[i].top = [(names[j], q) for j, q in zip(classes, chances, strict=True)]
    if m := sum(i < draw for i in good):  # the first m images read get pictures
        pictured = [(results[i], stems[i]) for i in good[:m]]
        _draw(module.net, x[:m], z[:m], probs.argmax(dim=1)[:m], pictured, out_dir)
    return results


def _draw(
    model: torch.nn.Module,
    x: torch.Tensor,
    z: torch.Tensor,
    classes: torch.Tensor,
    pictured: Sequence[tuple[Prediction, str]],
    out_dir: Path,
) -> None:
    """Write the two pictures of each image and set its result's ``picture``.

    Args:
        x: (P, 1, 28, 28) float32 in [0, 1], the model's inputs; ``z`` normalised.
        classes: (P,) int64, the predicted classes, whose relevance is drawn.
        pictured: the P predictions, ``top`` filled, with their file-name stems.

    The maps of all P images are computed and coloured together. A model without attention
    (the convnet teacher) gets the input picture alone.
    """
    inputs = (grey(x) * 255).round().to(torch.uint8)  # (P, 3, 28, 28)
    for picture, (_, stem) in zip(inputs, pictured, strict=True):
        save_png(picture, out_dir / f"{stem}_28x28.png")
    if not isinstance(model, VisionTransformer):
        return
    _, weights = model.forward_with_attention(z)
    weights = [w.float().cpu() for w in weights]
    relevance, _ = class_relevance(model, z, classes)  # (P, g, g)
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
    for i, (result, stem) in enumerate(pictured):
        best, confidence = result.top[0]
        name = printable_path(result.path.name)
        picture = labelled_grid(
            tiles[i : i + 1],
            row_labels=[""],
            col_labels=[*col_labels, f"relevance: {best}"],
            title=f"{name}: {best} ({100 * confidence:.1f}%), last layer",
        )
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
        best, p = r.top[0] if r.top else ("", None)
        values = [
            printable_path(r.path),
            best,
            "" if p is None else f"{p:.4f}",
            " ".join(f"{name}:{q:.3f}" for name, q in r.top),
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
    data = Path(path).read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        os.truncate(path, len(data))
        log.warning("%s: its last line was cut off; that image is predicted again", path)
    reader = csv.DictReader(io.StringIO(data.decode("utf-8", "replace")))
    if data and tuple(reader.fieldnames or ()) != CSV_COLUMNS:
        raise ConfigError(
            f"{path} does not have the columns of a predictions.csv ({','.join(CSV_COLUMNS)}); "
            "choose another run dir (hydra.run.dir=PATH) or move the file away"
        )
    # A row with too many fields has a None key, one with too few None values.
    return {row["path"]: row for row in reader if None not in row and None not in row.values()}


class _Interrupts:
    """Ctrl-C and SIGTERM as :class:`KeyboardInterrupt` while entered, held back while
    :meth:`held`, so a batch's rows are written and counted together or not at all."""

    signum: int | None = None  # the last signal taken
    _holding = False

    def _handler(self, signum: int, frame: Any) -> None:
        self.signum = signum
        if not self._holding:
            raise KeyboardInterrupt

    def __enter__(self) -> _Interrupts:
        self._previous = {
            s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)
        }
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)

    @contextmanager
    def held(self) -> Iterator[None]:
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self.signum is not None:  # taken while held
            raise KeyboardInterrupt


def _check_settings(cfg: DictConfig) -> None:
    """The settings, and that the run dir holds no ``predictions.csv`` but with ``resume``.

    Raises:
        CheckpointError: no ``ckpt_path``.
        ConfigError: no ``images``, a setting the schema refuses, or the CSV exists.
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
    csv_path = Path(cfg.paths.output_dir) / CSV_NAME
    if csv_path.exists() and not cfg.resume:
        raise ConfigError(
            f"{csv_path} exists already: add resume=true to predict only the files not in it, "
            "or leave hydra.run.dir out for a new run dir"
        )


def _collected(images: Any) -> tuple[list[Path], list[tuple[str, str]]]:
    """:func:`collect_images` of the ``images`` setting.

    Raises:
        ConfigError: it names no image at all; the line says why for each value.
    """
    paths, problems = collect_images(images)
    if not paths:
        found_nothing = "; ".join(f"{spec}: {reason}" for spec, reason in problems)
        raise ConfigError(
            f"images names no image: {found_nothing}; give files, folders of "
            "PNG/JPEG/BMP/WebP images or patterns, e.g. images=my_digits/ or "
            "images=[a.png,scans/7.jpg] or \"images='scans/**/*.png'\""
        )
    return paths, problems


def _append_rows(
    batches: Iterable[list[Prediction]], csv_path: Path, *, kept: int, total: int
) -> list[Prediction]:
    """Each batch appended to ``csv_path`` whole, a signal waiting for the batch being
    written; returns the predictions appended.

    Raises:
        SystemExit(130 or 143): Ctrl-C or SIGTERM, after a line saying how many of the
            images are in the CSV (``kept`` of ``total`` were there before) and how to go on.
    """
    results: list[Prediction] = []
    interrupts = _Interrupts()
    try:
        with interrupts:
            for batch in batches:
                with interrupts.held():
                    append_csv_rows(csv_path, csv_rows(batch), CSV_COLUMNS)
                    results += batch
    except KeyboardInterrupt:
        what = "SIGTERM" if interrupts.signum == signal.SIGTERM else "Ctrl-C"
        out_dir = csv_path.parent
        print(
            f"\nInterrupted ({what}): {kept + len(results)} of {total} images are "
            f"in {csv_path}; to predict the rest, run the same command with resume=true "
            f"{shlex.quote(f'hydra.run.dir={out_dir}')}",
            file=sys.stderr,
        )
        raise SystemExit(128 + (interrupts.signum or signal.SIGINT)) from None
    return results


def _print_results(
    results: list[Prediction], rows: list[dict[str, str]], earlier: int, out_dir: Path
) -> None:
    """One line per image of this run, or for more than :data:`LIST_AT_MOST` rows in the
    CSV (``earlier`` of them by an earlier run) a summary; a failed file has its line."""
    for r in results:
        if r.error:
            print(f"{printable_path(r.path)}: cannot be read ({r.error})")
        elif len(rows) <= LIST_AT_MOST:
            top = "  ".join(f"{name} ({100 * p:.1f}%)" for name, p in r.top)
            picture = f"   -> {printable_path(r.picture)}" if r.picture else ""
            print(f"{printable_path(r.path)}: {top}{picture}")
    if len(rows) > LIST_AT_MOST:
        n_failed = sum(bool(row["error"]) for row in rows)
        counts = Counter(row["predicted"] for row in rows if row["predicted"])
        classes = ", ".join(f"{name}: {n}" for name, n in sorted(counts.items()))
        drawn = sum(bool(row["attention"]) for row in rows)
        print(
            f"{len(rows) - n_failed} of {len(rows)} images predicted (classes {classes}"
            + (f"; {earlier} of them by the earlier run" if earlier else "")
            + f"); attention pictures of {drawn} in {out_dir}"
        )


def _print_pruned_speed(module: ViTClassifier) -> None:
    """For a pruned checkpoint (``eval.py analysis=prune``): its heads, parameters and
    images/s here beside a model of the unpruned shape, timed in turns on a batch of 256."""
    pruned_from = module.run_info["pruned_from"]
    net = module.net
    shape = (256, net.in_chans, net.img_size, net.img_size)
    s = speed_and_size(net, build_model(pruned_from["model"]), torch.zeros(shape))
    print(
        f"pruned model ({pruned_from['order']} order): {s['heads']['pruned']} of "
        f"{s['heads']['unpruned']} heads, {s['params']['pruned']:,} of "
        f"{s['params']['unpruned']:,} parameters; {s['images_per_s']['pruned']:,.0f} images/s "
        f"against {s['images_per_s']['unpruned']:,.0f} unpruned ({s['speedup']:.2f}x) on "
        f"{s['device']}"
    )


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
    _check_settings(cfg)
    out_dir = Path(cfg.paths.output_dir)
    csv_path = out_dir / CSV_NAME
    # The checkpoint first: a wrong ckpt_path is reported even when images are wrong too.
    module, data = load_model(resolve_ckpt_path(cfg))
    paths, problems = _collected(cfg.images)
    done = read_done_rows(csv_path) if csv_path.exists() else {}
    todo = [i for i, path in enumerate(paths) if printable_path(path) not in done]
    if cfg.resume:
        shown = len(paths) - len(todo), len(paths), csv_path
        log.info("resume=true: %d of the %d images are in %s already", *shown)
    stems = output_stems(paths)
    limit = len(paths) if cfg.pictures == "all" else int(cfg.pictures)
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
    unfound = [
        Prediction(path=Path(spec), error=reason)
        for spec, reason in problems
        if printable_path(Path(spec)) not in done
    ]
    results = _append_rows(
        chain(batches, [unfound] if unfound else []),
        csv_path,
        kept=len(paths) - len(todo),
        total=len(paths),
    )
    # Every row of the CSV, the earlier run's and this one's, for the counts.
    rows = [*done.values(), *csv_rows(results)]
    n_failed = sum(bool(row["error"]) for row in rows)
    _print_results(results, rows, len(done), out_dir)
    print(f"predictions: {csv_path}" + (f" ({n_failed} failed)" if n_failed else ""))
    if "pruned_from" in module.run_info:
        _print_pruned_speed(module)
    if n_failed:
        raise SystemExit(1)
    return results
