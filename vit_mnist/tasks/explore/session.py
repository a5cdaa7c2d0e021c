"""The explorer's session: a checkpoint's model and everything the page shows of it
(:class:`Explorer`), an image at a time, with no Gradio.

Every number and map comes from :func:`vit_mnist.analysis.explain.explain_image` (one
forward and backward pass per input, the heads switched off given as an argument, so
sessions never see each other's), which calls the functions TensorBoard, ``predict.py`` and
``eval.py analysis=heads`` use; a drawn or uploaded image is preprocessed as ``predict.py``
does (:func:`~vit_mnist.data.images.mnist_preprocess`) and read with its guards; the
pictures are :mod:`vit_mnist.analysis.drawing`'s.
"""

from __future__ import annotations

import base64
import csv
import io
import itertools
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from PIL import Image

from vit_mnist.analysis import drawing
from vit_mnist.analysis.explain import ImageExplanation, explain_image
from vit_mnist.analysis.roles import ROLE_COLUMNS
from vit_mnist.data.images import IMAGE_SUFFIXES, UNREADABLE, mnist_preprocess
from vit_mnist.errors import CheckpointError, ConfigError, DataError
from vit_mnist.io import atomic_write_bytes, save_png
from vit_mnist.models.vit import VisionTransformer
from vit_mnist.training.callbacks.attention_maps import panel_indices
from vit_mnist.training.checkpointing import (
    checkpoint_datamodule,
    load_model,
    read_checkpoint,
    resolve_ckpt_path,
)
from vit_mnist.training.module import RUN_INFO_KEY

log = logging.getLogger(__name__)

ZOOM = 8  # screen pixels per image pixel of the 28 x 28 input and the explanation maps
MODEL_VIEW_ZOOM = 3  # and of each tile of the model view (6 x 4 tiles of 84 px)
MATRIX_SIDE = 340  # px: the attention matrix's cells at most this wide together
TOP_K = 3  # classes in the prediction panel
# The Draw tab's canvas (vit_mnist/tasks/explore/page.py), whose drawing the session reads.
CANVAS_SIDE = 280  # px
PREDICTED = -1  # the explanation dropdown's value for "the predicted class"
# The logit lens's two lines, the same names for every image: Gradio's line plot keeps the
# colours' domain of its first picture and draws no line whose name is not in it.
LENS_LINES = ("predicted", "compared")
# The columns of eval.py's head_importance.csv (analysis=heads) that the head table shows,
# in this order; and those of its roles.csv (analysis=roles).
HEAD_TABLE_COLUMNS = tuple(
    "layer head acc_drop loss_increase grad_importance entropy_nats mean_distance_px".split()
)
ROLE_TABLE_COLUMNS = ("layer", "head", "acc_drop", *ROLE_COLUMNS, "most_hurt_class")


def original_heads(ckpt: dict[str, Any]) -> list[list[int]]:
    """Per block, the numbers its heads had before pruning (``[[0, 1, 2, 3], ...]`` for an
    unpruned model; for ``eval.py analysis=prune``'s ``pruned.ckpt`` its remaining heads,
    read from the ``pruned_heads`` it stores: ``"layer:head layer:head"`` per step)."""
    args = ckpt["hyper_parameters"]["model"]
    depth, counts = int(args["depth"]), args["num_heads"]
    counts = list(counts) if isinstance(counts, list | tuple) else [int(counts)] * depth
    removed: list[set[int]] = [set() for _ in range(depth)]
    for pair in " ".join(map(str, ckpt.get("pruned_heads", []))).split():
        layer, _, head = pair.partition(":")
        removed[int(layer)].add(int(head))
    heads = []
    for layer, count in enumerate(counts):
        kept = [h for h in range(count + len(removed[layer])) if h not in removed[layer]]
        heads.append(kept if len(kept) == count else list(range(count)))
    return heads


def read_head_table(path: str | Path) -> tuple[list[str], list[list[Any]]]:
    """The headers and rows of the head table: ``eval.py analysis=heads``'
    ``head_importance.csv`` (:data:`HEAD_TABLE_COLUMNS`) or ``analysis=roles``' ``roles.csv``
    (:data:`ROLE_TABLE_COLUMNS`), most important (largest accuracy drop) first; ``acc_drop``
    in points.

    Raises:
        ConfigError: the file is missing or lacks one of the columns.
    """
    path = Path(path)
    fix = (
        "give heads_csv=<eval run>/head_importance.csv or roles.csv "
        "(eval.py ckpt_path=... analysis=heads or analysis=roles)"
    )
    try:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise ConfigError(f"heads_csv={path} cannot be read ({e.strerror or e}); {fix}") from None
    columns = ROLE_TABLE_COLUMNS if rows and "ink_share" in rows[0] else HEAD_TABLE_COLUMNS
    missing = [c for c in columns if rows and c not in rows[0]]
    if not rows or missing:
        raise ConfigError(f"heads_csv={path} has no rows or lacks columns {missing}; {fix}")
    table = [
        [int(r["layer"]), int(r["head"]), round(100 * float(r["acc_drop"]), 3)]
        + [r[c] if c == "most_hurt_class" else float(r[c]) for c in columns[3:]]
        for r in sorted(rows, key=lambda r: -float(r["acc_drop"]))
    ]
    return ["layer", "head", "acc_drop (points)", *columns[3:]], table


@dataclass
class View:
    """What the page shows for one image and one choice of controls: pictures as
    (height, width, 3) uint8 arrays, texts, the numbers they were drawn from, and the
    settings that reproduce them. ``writes`` is each head's direct logit attribution,
    ``lens`` the logit lens as a table (block, probability %, class) for a line plot."""

    explanation: ImageExplanation
    top: dict[str, float]
    summary: str
    seen: np.ndarray
    model_view: np.ndarray
    query_view: np.ndarray
    matrix: np.ndarray | None
    rollout: np.ndarray
    relevance: np.ndarray
    writes: np.ndarray
    lens: Any
    settings: dict[str, Any] = field(default_factory=dict)


def picture_array(picture: torch.Tensor) -> np.ndarray:
    """(3, H, W) uint8 or float in [0, 1] -> (H, W, 3) uint8, as Gradio shows it."""
    if picture.dtype != torch.uint8:
        picture = _tensor(picture)
    return picture.permute(1, 2, 0).contiguous().numpy()


def _tensor(picture: torch.Tensor) -> torch.Tensor:
    """(3, H, W) float in [0, 1] -> uint8."""
    return (picture.clamp(0, 1) * 255).round().to(torch.uint8)


def zoomed(picture: torch.Tensor, zoom: int = ZOOM) -> torch.Tensor:
    """(N, 3, H, W) -> each pixel a zoom x zoom square."""
    return F.interpolate(picture.float(), scale_factor=zoom, mode="nearest")


def colour_range(maps: Sequence[torch.Tensor], shared: bool) -> tuple[float | None, float | None]:
    """The values at the colour map's ends for a panel of ``maps``: shared, 0 and the
    largest value of any of them; else None, None: each map from its own minimum to its own
    maximum."""
    if not shared:
        return None, None
    return 0.0, max(float(m.max()) for m in maps)


def _bar(picture: torch.Tensor, maps: list[torch.Tensor], shared: bool, caption: str) -> np.ndarray:
    """``picture`` with the colour bar of its ``maps`` under it, as Gradio shows it."""
    low, high = colour_range(maps, shared)
    if low is None and len(maps) == 1:  # one map scaled to itself: its own range
        low, high = float(maps[0].min()), float(maps[0].max())
    ends = ("each map's min", "its max") if low is None else (f"{low:.3g}", f"{high:.3g}")
    return picture_array(
        drawing.with_colour_bar(picture, low=ends[0], high=ends[1], caption=caption)
    )


@dataclass
class Explorer:
    """A checkpoint's model and what the page needs around it; the page's callbacks call
    :meth:`view`, :meth:`query` and the ``from_*`` readers, so tests can call them without a
    browser. Nothing here changes once the page is built: sessions share it.

    Attributes:
        model: the network, in eval mode, on the CPU.
        mean, std: the normalisation it was trained with (pixels in [0, 1]).
        class_names: by class index.
        head_names: per block, the numbers of its heads in the unpruned model.
        examples: the validation panel of the TensorBoard callback, one image per class,
            as (images (10, 1, 28, 28) normalised, labels (10,)); None without the data.
        test_set: the test split (``dataset[i] -> (image, label)``), or None.
        head_table: :func:`read_head_table`'s headers and rows, or None.
        title: a line naming the checkpoint.
        max_megapixels: uploads of more pixels are refused before they are decoded.
        run_dir: where "save this view" writes; None: the page offers no saving.
    """

    model: VisionTransformer
    mean: float = 0.1307
    std: float = 0.3081
    class_names: Sequence[str] = tuple(str(i) for i in range(10))
    head_names: list[list[int]] = field(default_factory=list)
    examples: tuple[torch.Tensor, torch.Tensor] | None = None
    test_set: Any = None
    head_table: tuple[list[str], list[list[Any]]] | None = None
    title: str = ""
    max_megapixels: float = 25.0
    run_dir: Path | None = None

    def __post_init__(self) -> None:
        if not self.head_names:
            self.head_names = [list(range(b.attn.num_heads)) for b in self.model.blocks]

    # ------------------------------------------------------------------ inputs

    def from_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """(1, 28, 28) in [0, 1] (1 = ink) -> (1, 1, 28, 28) normalised, as trained."""
        return ((pixels - self.mean) / self.std)[None]

    def from_file(self, path: str | Path) -> torch.Tensor:
        """An uploaded image file, read as ``predict.py`` reads one (EXIF orientation,
        16-bit grey) and made MNIST-like; its size is checked before its pixels are decoded.

        Raises:
            ValueError: the file is not an image type ``predict.py`` reads, has more than
                :attr:`max_megapixels`, cannot be decoded or holds no digit; the message
                names the file (not where the server keeps it) in the user's words.
        """
        name = Path(path).name
        if Path(path).suffix.lower() not in IMAGE_SUFFIXES:
            raise ValueError(f"{name}: not one of {', '.join(IMAGE_SUFFIXES)}")
        too_big = (
            f"the explorer reads images of at most {self.max_megapixels:g} megapixels "
            "(max_upload_megapixels); scale it down"
        )
        try:
            with Image.open(path) as image:  # reads the header only
                width, height = image.size
                if width * height > self.max_megapixels * 1e6:
                    raise ValueError(
                        f"{name} has {width} x {height} pixels ({width * height / 1e6:.0f} "
                        f"megapixels); {too_big}"
                    )
                image.load()
                return self.from_pixels(mnist_preprocess(image))
        except Image.DecompressionBombError:
            raise ValueError(f"{name} has too many pixels; {too_big}") from None
        except ValueError as e:  # too big, or mnist_preprocess: no digit in it
            raise ValueError(str(e) if name in str(e) else f"{name}: {e}") from None
        except UNREADABLE:
            raise ValueError(
                f"{name} cannot be read as an image: it is damaged or not really a "
                "PNG, JPEG, BMP or WebP file"
            ) from None

    def from_sketch(self, png: str | None) -> torch.Tensor | None:
        """The Draw tab's drawing, as its canvas sends it: a PNG data URL
        (``data:image/png;base64,...``) of :data:`CANVAS_SIDE` pixels square, dark ink on a
        transparent canvas. None while it is blank (or cleared).

        Raises:
            ValueError: not a PNG data URL of the canvas's size (only an API call can send
                one), said in the user's words.
        """
        if not png:
            return None
        head, _, data = str(png).partition(",")
        try:
            # Twice the canvas's raw RGBA bytes, in base64 characters: its PNG is far shorter.
            if head != "data:image/png;base64" or len(data) > 2 * 4 * CANVAS_SIDE**2:
                raise ValueError
            with Image.open(io.BytesIO(base64.b64decode(data, validate=True))) as image:
                if image.format != "PNG" or image.size != (CANVAS_SIDE, CANVAS_SIDE):
                    raise ValueError  # checked on the header, before the pixels are decoded
                image.load()
        except (ValueError, *UNREADABLE):
            raise ValueError(
                f"a drawing is sent as a PNG data URL of {CANVAS_SIDE} x {CANVAS_SIDE} pixels "
                "(data:image/png;base64,...), as the Draw tab's canvas sends it"
            ) from None
        try:
            return self.from_pixels(mnist_preprocess(image))
        except ValueError:  # nothing drawn yet, or everything erased
            return None

    def from_test(self, index: int) -> tuple[torch.Tensor, int]:
        """Test image ``index`` (normalised, as the datamodule serves it) and its label.

        Raises:
            ValueError: no test set here, or ``index`` outside it.
        """
        if self.test_set is None:
            raise ValueError("no test images here: the checkpoint's dataset cannot be read")
        if not 0 <= index < len(self.test_set):
            raise ValueError(f"test image {index}: choose 0 to {len(self.test_set) - 1}")
        image, label = self.test_set[index]
        return torch.as_tensor(image).float().cpu()[None], int(label)

    def heads_off(self, checked: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
        """(layer, head) pairs not in ``checked`` (per block, the heads left on)."""
        return [
            (layer, h)
            for layer, on in enumerate(checked)
            for h in range(len(self.head_names[layer]))
            if h not in set(on or [])
        ]

    # ------------------------------------------------------------------ pictures

    def explain(
        self, x: torch.Tensor, heads_off: Sequence[tuple[int, int]] = (), target: int | None = None
    ) -> ImageExplanation:
        """:func:`explain_image` of image ``x`` (1, 1, 28, 28) normalised: the page's one
        computation per input. ``target`` None or :data:`PREDICTED`: the predicted class."""
        target = None if target is None or target == PREDICTED else int(target)
        return explain_image(self.model, x, heads_off=heads_off, target=target)

    def view(
        self,
        x: torch.Tensor,
        *,
        heads_off: Sequence[tuple[int, int]] = (),
        target: int | None = None,
        layer: int = 0,
        token: int = 0,
        matrix_head: int | None = None,
        shared: bool = False,
        source: str = "",
        explanation: ImageExplanation | None = None,
    ) -> View:
        """Everything the page shows for image ``x`` (1, 1, 28, 28) normalised.

        Args:
            heads_off: (layer, head) pairs switched off, heads numbered within the block.
            target: the class the relevance explains; None or :data:`PREDICTED`: the
                predicted one.
            layer, token, matrix_head: the query view's, see :meth:`query`.
            shared: colour every map of a panel on one scale, from 0 to the panel's largest
                value; False: each map from its own minimum to its own maximum.
            source: where the image came from, for the summary line.
            explanation: :meth:`explain` of ``x`` with these ``heads_off`` and ``target``,
                when the caller has it (the model is then not run).
        """
        e = explanation or self.explain(x, heads_off, target)
        names = self.class_names
        p, c = e.probs.topk(min(TOP_K, len(e.probs)))
        top = {names[j]: float(q) for j, q in zip(c.tolist(), p.tolist(), strict=True)}
        image = x.float().cpu()
        summary = f"predicted: {names[e.predicted]} ({100 * float(e.probs.max()):.1f}%)"
        if e.heads_off:
            base = int(e.base_probs.argmax())
            before, after = 100 * float(e.base_probs[base]), 100 * float(e.probs[base])
            n = len(e.heads_off)
            summary += (
                f"; {n} head{'s' * (n != 1)} off: "
                f"p({names[base]}) {before:.1f}% -> {after:.1f}% ({after - before:+.1f} points)"
            )
        if source:
            summary = f"{source}: {summary}"
        seen, query_view, matrix = self.query(
            e, x, layer=layer, token=token, matrix_head=matrix_head, shared=shared
        )
        # "Why not a 9?": the class asked about, else the runner-up.
        others = e.probs.clone()
        others[e.predicted] = -1
        other = e.target if e.target != e.predicted else int(others.argmax())
        return View(
            explanation=e,
            top=top,
            summary=summary,
            seen=seen,
            model_view=self._heads(e, image, shared, layer=None, token=0),
            query_view=query_view,
            matrix=matrix,
            rollout=self._single(
                image, e.rollout, shared, "rollout: how much of each patch reaches CLS"
            ),
            relevance=self._single(
                image, e.relevance, shared, f"relevance for class {names[e.target]}"
            ),
            writes=self._writes(e, e.predicted, other),
            lens=self._lens(e, e.predicted, other),
            settings={
                "heads_off": [f"{lyr}:{h}" for lyr, h in e.heads_off],
                "target": None if target is None or target == PREDICTED else int(target),
                "layer": layer,
                "token": token,
                "matrix_head": matrix_head,
                "colour_scale": "shared" if shared else "each map",
                "source": source,
            },
        )

    def query(
        self,
        e: ImageExplanation,
        x: torch.Tensor,
        *,
        layer: int = 0,
        token: int = 0,
        matrix_head: int | None = None,
        shared: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The query view's pictures, drawn from ``e`` (:meth:`explain` of ``x``) without
        running the model: the input with the patch grid and the query patch outlined,
        where query ``token`` attends in ``layer`` per head, and head ``matrix_head``'s
        full attention matrix (None: no matrix).

        Args:
            layer, token: the query view's layer and query token (0 = CLS, 1 = the
                distillation token of a distilled model, ``model.num_prefix_tokens + r *
                grid + c`` = patch (r, c)); out of range: the nearest.
            matrix_head: a head of ``layer``; None or out of range: no matrix.
            shared: as in :meth:`view`.
        """
        image = x.float().cpu()
        layer = min(max(0, layer), len(e.weights) - 1)
        token = min(max(0, token), e.weights[layer].shape[-1] - 1)
        matrix = None
        if matrix_head is not None and 0 <= matrix_head < len(e.weights[layer]):
            w = e.weights[layer][matrix_head]
            lo, hi = colour_range([w], shared)
            names = [self._name(t, short=True) for t in range(len(w))]
            cell = max(6, MATRIX_SIDE // len(w))
            picture = drawing.attention_matrix(w, names, cell=cell, low=lo, high=hi)
            matrix = _bar(picture, [w], shared, "attention weight (row: query, column: key)")
        query_view = self._heads(e, image, shared, layer=layer, token=token)
        return picture_array(self._seen(image, token)), query_view, matrix

    def _heads(
        self, e: ImageExplanation, image: torch.Tensor, shared: bool, layer: int | None, token: int
    ) -> np.ndarray:
        """Where query ``token`` attends per head of ``layer`` (the query view) or, None, of
        every layer (the model view, one row a layer), over ``image``, with one colour bar: a
        switched-off head crossed out and left out of the colour scale."""
        model_view = layer is None
        layers = range(len(e.weights)) if model_view else [layer]
        maps = {lyr: e.token_maps(lyr, token) for lyr in layers}
        on = [m for lyr in layers for h, m in enumerate(maps[lyr]) if (lyr, h) not in e.heads_off]
        on = on or [torch.zeros(1)]  # every head off
        low, high = colour_range(on, shared)

        def label(lyr: int, h: int) -> str:
            name, off = f"head {self.head_names[lyr][h]}", (lyr, h) in e.heads_off
            if not model_view:
                return f"{name} OFF" if off else name
            if off:
                return f"{name} OFF\n(output zeroed)"
            stats = f"{float(e.entropy[lyr][h]):.2f} nats, {float(e.distance[lyr][h]):.1f} px"
            return f"{name}\n{stats}"

        rows = []
        for lyr, m in maps.items():
            tiles = drawing.overlay(image.expand(len(m), -1, -1, -1), m, low=low, high=high)
            tiles[[h for off, h in e.heads_off if off == lyr]] = drawing.crossed_out(image)
            rows.append(tiles)
        picture = drawing.tile_table(
            rows,
            row_labels=[f"layer {lyr}" for lyr in layers],
            captions=[[label(lyr, h) for h in range(len(m))] for lyr, m in maps.items()],
            zoom=MODEL_VIEW_ZOOM if model_view else 4,
        )
        if model_view:
            return _bar(picture, on, shared, "the CLS token's attention weight")
        return _bar(picture, on, shared, f"attention weight of {self._name(token)}")

    def _writes(self, e: ImageExplanation, a: int, b: int) -> np.ndarray:
        """Each head's direct logit attribution (layers x heads, a switched-off head
        marked): to class ``a``'s logit, and to ``logit_a - logit_b``, with a colour bar."""
        names = self.class_names
        tables = [e.head_attribution(a), e.head_attribution(a, b)]
        finite = torch.cat([t[t.isfinite()] for t in tables]).abs()
        limit = float(finite.max()) if finite.numel() and finite.max() > 0 else 1.0
        off = torch.zeros(tables[0].shape, dtype=torch.bool)
        for layer, h in e.heads_off:
            off[layer, h] = True
        rows = [f"layer {layer}" for layer in range(len(e.weights))]
        cols = [f"head {h}" for h in range(tables[0].shape[1])]
        titles = [f"to logit {names[a]}", f"to logit {names[a]} - logit {names[b]}"]
        pictures = [
            drawing.value_table(t, row_labels=rows, col_labels=cols, limit=limit, off=off)
            for t in tables
        ]
        return picture_array(
            drawing.with_colour_bar(
                drawing.stack_pictures(pictures, titles),
                low=f"-{limit:.2f}",
                high=f"+{limit:.2f}",
                caption="direct contribution, logits (red: for, blue: against)",
                cmap="RdBu_r",
            )
        )

    def _lens(self, e: ImageExplanation, a: int, b: int) -> Any:
        """The logit lens of classes ``a`` (predicted) and ``b`` (compared): a table of
        block, probability (%), class and line (``LENS_LINES``), for Gradio's line plot."""
        import pandas as pd

        # Block numbers as labels, not numbers: a number axis put ticks at 0.5, 1.5, ...
        # between the blocks (the page orders them, page.py's LinePlot ``sort``).
        blocks = [str(b) for b in range(len(e.lens))]
        return pd.DataFrame(
            {
                "after block": blocks * 2,
                "probability %": [100 * float(p) for c in (a, b) for p in e.lens[:, c]],
                "class": [f"class {self.class_names[c]}" for c in (a, b) for _ in blocks],
                "line": [name for name in LENS_LINES for _ in blocks],
            }
        )

    @staticmethod
    def _single(image: torch.Tensor, m: torch.Tensor, shared: bool, caption: str) -> np.ndarray:
        """One (grid, grid) map over the zoomed image, with its colour bar."""
        low, high = colour_range([m], shared)
        picture = zoomed(drawing.overlay(image, m[None], low=low, high=high))[0]
        return _bar(_tensor(picture), [m], shared, caption)

    def _name(self, token: int, short: bool = False) -> str:
        """The name of ``token``: CLS, the distillation token, or patch (row, column)."""
        prefix, grid = self.model.num_prefix_tokens, self.model.patch_embed.grid_size
        if token < prefix:
            return ("CLS", "dist." if short else "the distillation token")[token]
        r, c = divmod(token - prefix, grid)
        return f"{r},{c}" if short else f"patch {r},{c}"

    def _seen(self, image: torch.Tensor, token: int) -> torch.Tensor:
        """The 28 x 28 input, zoomed, with the patch grid and the query patch outlined."""
        grid, prefix = self.model.patch_embed.grid_size, self.model.num_prefix_tokens
        picture = zoomed(drawing.grey(image))[0]  # (3, 28 * ZOOM, 28 * ZOOM)
        step = picture.shape[-1] // grid
        picture[:, ::step, :] = picture[:, :, ::step] = 0.35
        if token >= prefix:
            r, c = divmod(token - prefix, grid)
            box = picture[:, r * step : (r + 1) * step, c * step : (c + 1) * step]
            red = torch.tensor([1.0, 0.2, 0.2])[:, None, None]
            box[:, :2] = box[:, -2:] = box[:, :, :2] = box[:, :, -2:] = red
        return picture

    def token_at(self, x: float, y: float) -> int:
        """The query token of the patch under pixel (x, y) of the zoomed input picture."""
        grid = self.model.patch_embed.grid_size
        side = self.model.patch_embed.img_size * ZOOM
        r, c = (min(grid - 1, max(0, int(v * grid // side))) for v in (y, x))
        return self.model.num_prefix_tokens + r * grid + c

    def save(self, view: View, image: torch.Tensor) -> Path:
        """Write ``view`` into :attr:`run_dir`: ``views/view-NNN.png``, every panel in one
        picture, and beside it ``view-NNN.json``, the settings that reproduce it (the
        checkpoint, the controls, and the 28 x 28 input's pixels in [0, 1], 1 = ink, for a
        drawing).

        Returns:
            The PNG's path.

        Raises:
            ConfigError: no run dir (the page was not started by ``scripts/explore.py``).
            WriteError: the folder cannot be written.
        """
        if self.run_dir is None:
            raise ConfigError("no run dir to save into: start the page with scripts/explore.py")
        folder = Path(self.run_dir) / "views"
        taken = {p.stem for p in folder.glob("view-*.png")}
        stem = next(s for s in map("view-{:03d}".format, itertools.count(1)) if s not in taken)
        panels = {  # title: picture
            "the input (28 x 28) and the query patch: " + view.summary: view.seen,
            "attention rollout": view.rollout,
            f"class relevance of {self.class_names[view.explanation.target]}": view.relevance,
            "model view: the CLS token's attention, every layer and head": view.model_view,
            "query view": view.query_view,
            "what each head writes: direct logit attribution": view.writes,
            "attention matrix": view.matrix,
        }
        shown = {t: a for t, a in panels.items() if a is not None}
        pictures = [torch.from_numpy(a).permute(2, 0, 1) for a in shown.values()]
        picture = drawing.stack_pictures(pictures, list(shown))
        pixels = (image.float().cpu() * self.std + self.mean)[0, 0]  # as from_pixels takes
        settings = {
            "ckpt_path": self.title,
            **view.settings,
            "predicted": self.class_names[view.explanation.predicted],
            "input_pixels": [[round(v, 4) for v in row] for row in pixels.tolist()],
        }
        save_png(picture, folder / f"{stem}.png")
        atomic_write_bytes(
            folder / f"{stem}.json", (json.dumps(settings, indent=1) + "\n").encode()
        )
        return folder / f"{stem}.png"


# ---------------------------------------------------------------------------------- loading


def load_explorer(cfg: DictConfig) -> Explorer:
    """The :class:`Explorer` of ``cfg.ckpt_path`` (``latest`` resolves), with the
    checkpoint's dataset for the examples and test images where it can be read.

    Raises:
        CheckpointError: no or an unreadable checkpoint.
        ConfigError: ``heads_csv`` given but unreadable, or a convnet's checkpoint.
    """
    path = resolve_ckpt_path(cfg)
    module, data = load_model(path)
    ckpt = read_checkpoint(path)
    if not isinstance(module.net, VisionTransformer):
        raise ConfigError(f"{path} is a convnet (model=cnn): the explorer shows attention heads")
    explorer = Explorer(
        model=module.net.eval(),
        mean=float(data.get("mean", 0.1307)),
        std=float(data.get("std", 0.3081)),
        head_names=original_heads(ckpt),
        title=f"{path}",
        max_megapixels=float(cfg.max_upload_megapixels),
        head_table=read_head_table(cfg.heads_csv) if cfg.get("heads_csv") else None,
    )
    try:
        datamodule = checkpoint_datamodule(cfg, path, ckpt.get(RUN_INFO_KEY, {}))
        datamodule.prepare_data()
        datamodule.setup("fit")
    except (DataError, CheckpointError, OSError) as e:
        log.warning("no examples or test images: the dataset cannot be read (%s)", e)
        return explorer
    explorer.class_names = list(getattr(datamodule, "class_names", explorer.class_names))
    val = datamodule.data_val
    labels = torch.as_tensor([int(val[i][1]) for i in range(len(val))])
    chosen = panel_indices(labels, len(explorer.class_names))
    images = torch.stack([torch.as_tensor(val[i][0]).float().cpu() for i in chosen])
    explorer.examples = (images, labels[chosen])
    explorer.test_set = datamodule.data_test
    return explorer
