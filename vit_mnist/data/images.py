"""A person's own images of digits, made into MNIST's form: the files that ``images=``
names (files, folders and glob patterns, walked without stopping on a bad entry) and the
preprocessing of one photo or scan into a 28 x 28 digit as MNIST's were made. Used by
``predict.py`` and by the explorer's uploads and drawings."""

from __future__ import annotations

import errno
import glob
import logging
import os
import stat
from collections import Counter
from collections.abc import Iterable
from itertools import takewhile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps
from torchvision.transforms.v2 import functional as TF

from vit_mnist.io import printable_path

log = logging.getLogger(__name__)

MNIST_BOX = 20  # pixels: MNIST digits fit a 20 x 20 box...
MNIST_SIZE = 28  # ...centred by centre of mass in a 28 x 28 image,
MNIST_CENTRE = 14.0  # at this row and column index.
# What reading one image can raise that means a bad file, not a bug: besides OSError (and
# UnidentifiedImageError, one), PIL raises SyntaxError and EOFError for some malformed files
# (APNG frames, a JPEG's MP index) and DecompressionBombError beyond twice its pixel limit;
# mnist_preprocess ValueError.
UNREADABLE = (OSError, SyntaxError, EOFError, ValueError, Image.DecompressionBombError)

# What a folder or a pattern contributes: the suffixes PIL decodes in every install.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
GLOB_CHARS = frozenset("*?[")


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
        depth = next((d for d in (1.0, 255.0, 65535.0) if a.max() <= d), float(a.max()))
        a = np.clip(a / depth, 0.0, 1.0)
    else:
        a = np.asarray(image.convert("L"), dtype=np.float32) / 255.0

    def paper(a: np.ndarray) -> float:  # the median grey level of the border pixels
        return float(np.median(np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]])))

    if paper(a) > 0.5:
        a = 1.0 - a
    a = np.clip(a - paper(a), 0.0, None)
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
    # A negative padding crops: the part of a lopsided digit that falls outside is cut off.
    pads = (left, MNIST_SIZE - left - new_w, top, MNIST_SIZE - top - new_h)
    return F.pad(digit, pads)[None]


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
        if not isinstance(e, FileNotFoundError):
            return f"cannot be reached ({e.strerror or e})"
        if not path.is_symlink():
            return "no such file or folder"
        try:
            return f"a dangling link (to {os.readlink(path)})"
        except OSError:
            return "a dangling link"
    except ValueError as e:  # a name the OS cannot take (a NUL byte)
        return f"not a usable path ({e})"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISREG(mode):
        return "file"
    what = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"{what}, not an image file"


def _keep_images(candidates: Iterable[Path], origin: str, hint: str | None = None) -> list[Path]:
    """The image files among ``candidates`` (files and folders), sorted; one log line, for
    ``origin`` (the ``images=`` value), on the other files left out and, with a ``hint`` on
    how to reach them, the subfolders. Loops, dangling links and special files get one
    warning line each."""
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
    if n := sum(skipped.values()):
        kinds = ", ".join(k if c == 1 else f"{k} x{c}" for k, c in sorted(skipped.items()))
        parts.append(f"{n} file{'s' * (n != 1)} not PNG/JPEG/BMP/WebP ({kinds})")
    if folders and hint is not None:
        parts.append(f"{folders} subfolder{'s' * (folders != 1)} ({hint})")
    if parts:
        log.info("%s: skipped %s", origin, " and ".join(parts))
    return images


def _unsafe_folders(pattern: str) -> tuple[str, ...]:
    """For a ``**`` pattern: the folders under its root that :func:`glob.glob` would walk
    into without a word, each named in one warning line.

    A subfolder that cannot be listed is skipped by glob in silence; a link to a folder
    that holds it (``loop -> ..``) is followed by glob again and again, some 40 levels
    deep. Returns the loops, each with a trailing separator: the caller drops the matches
    that start with one.
    """
    loops: list[str] = []

    def unlisted(error: OSError) -> None:
        shown = printable_path(error.filename), error.strerror or error
        log.warning("%s: a subfolder that cannot be listed (%s); skipped", *shown)

    # The root: the pattern's leading parts that hold no glob character.
    root = Path(*takewhile(lambda part: not GLOB_CHARS & set(part), Path(pattern).parts))
    for folder, subfolders, _ in os.walk(root, onerror=unlisted):
        here = os.path.realpath(folder) + os.sep
        for path in (Path(folder, name) for name in subfolders):  # links to folders too
            target = os.path.realpath(path)
            if path.is_symlink() and here.startswith(target + os.sep):
                shown = printable_path(path), printable_path(target)
                log.warning("%s: a symlink loop (to %s, which holds it); skipped", *shown)
                loops.append(f"{path}{os.sep}")
    return tuple(loops)


def collect_images(
    specs: str | Path | Iterable[str | Path],
) -> tuple[list[Path], list[tuple[str, str]]]:
    """The image files that ``images=`` names: files, folders and glob patterns.

    Each value is read as the first of these that applies:

    * an existing file: taken as is, whatever its suffix (one that is not an image then
      fails by name when decoded);
    * an existing folder: its files ending in .png, .jpg, .jpeg, .bmp or .webp (any case),
      sorted by name; not its subfolders (a ``**`` pattern searches those). Other files,
      hidden files and subfolders are skipped, with one log line per folder saying how
      many and which suffixes;
    * a pattern (it holds ``*``, ``?`` or ``[``), expanded by :func:`glob.glob` with ``**``
      matching any depth of folders: the image files it matches, sorted, then the images
      directly inside the folders it matches. A matched file that is not an image is
      skipped (logged as for a folder): the pattern chose it, not the user.

    Nothing on the way stops the walk: symlink loops, dangling links, special files
    (FIFOs, sockets, devices) and subfolders that cannot be listed get one warning line
    each and are skipped (:func:`file_kind`). A leading ``~`` is the home folder; relative
    paths start at the current directory. A file reached twice (``a.png`` and ``./a.png``,
    or by a folder and a pattern) is kept once, at its first place.

    Args:
        specs: one value or a list of them (a Hydra ``ListConfig`` too); non-strings
            (Hydra reads ``images=7`` as an int) are taken as their text.

    Returns:
        ``(paths, problems)``: the files in order; and ``(value, reason)`` for each value
        that gave no image (missing, a loop, a dangling link or a special file; a pattern
        matching nothing; a folder or pattern with no image among its files; a folder that
        cannot be listed). Nothing is raised for them: the caller decides.
    """
    if isinstance(specs, (str, Path)):
        specs = [specs]
    unique: dict[str, Path] = {}  # by real path, the first path that reached it
    problems: list[tuple[str, str]] = []
    for spec in map(str, specs):
        target = Path(os.path.expanduser(spec))
        kind = file_kind(target)
        found = []
        if kind == "file":
            found = [target]
        elif kind == "folder":
            try:
                entries = list(target.iterdir())
            except OSError as e:  # no permission to list it, say: that value fails alone
                problems.append((spec, f"the folder cannot be listed ({e.strerror or e})"))
                continue
            hint = f"not searched; images='{(target / '**' / '*.png').as_posix()}' would"
            if not (found := _keep_images(entries, spec, hint)):
                problems.append((spec, "the folder holds no PNG/JPEG/BMP/WebP file"))
        elif GLOB_CHARS & set(spec):
            loops = _unsafe_folders(str(target)) if "**" in spec else ()
            matches = sorted(glob.glob(str(target), recursive=True))
            matches = [Path(m) for m in matches if not m.startswith(loops)]
            found = _keep_images(matches, spec)  # the matched folders are not mentioned
            for folder in (m for m in matches if file_kind(m) == "folder"):
                # A matched folder that cannot be listed adds nothing; the pattern's
                # other matches still count.
                try:
                    found += _keep_images(list(folder.iterdir()), str(folder))
                except OSError as e:
                    shown = printable_path(folder), e.strerror or e
                    log.warning("%s: cannot be listed (%s)", *shown)
            if not matches:
                problems.append((spec, "no file matches this pattern"))
            elif not found:
                problems.append((spec, "the pattern matches no PNG/JPEG/BMP/WebP file"))
        else:
            problems.append((spec, kind))
        for path in found:
            # realpath, not Path.resolve: it does not raise on a symlink loop.
            unique.setdefault(os.path.realpath(path), path)
    return list(unique.values()), problems


def read_image(path: Path) -> torch.Tensor:
    """:func:`mnist_preprocess` of the file at ``path``; a warning line when it is animated."""
    with Image.open(path) as image:
        image.load()
        if (frames := getattr(image, "n_frames", 1)) > 1:
            shown = printable_path(path), frames
            log.warning("%s: an animation of %d frames; its first frame is predicted", *shown)
        return mnist_preprocess(image)
