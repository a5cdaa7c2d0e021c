"""The attention explorer: a local web page (Gradio) on which a person draws, uploads or
picks a digit and sees every layer and head of a checkpoint's model at once, asks where a
patch attends, asks why a class and not another, and switches heads off.

The page only lays out and calls: every number and map comes from
:func:`vit_mnist.analysis.explain.explain_image`, which calls the functions TensorBoard,
``predict.py`` and ``eval.py analysis=heads`` use; the preprocessing of a drawn or
uploaded image is ``predict.py``'s :func:`~vit_mnist.predict.mnist_preprocess`.

Safe by default: bound to 127.0.0.1 unless ``server_name`` says otherwise, Gradio's
telemetry off, uploads limited to ``max_upload_mb`` and read by this module with
``predict.py``'s guards, and no file served but the pictures the page makes.
"""

from __future__ import annotations

import csv
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from PIL import Image

from vit_mnist.analysis.explain import ImageExplanation, explain_image
from vit_mnist.analysis.roles import ROLE_COLUMNS
from vit_mnist.callbacks.attention_maps import panel_indices
from vit_mnist.checkpointing import checkpoint_datamodule, read_checkpoint, resolve_ckpt_path
from vit_mnist.drawing import colorize, grey, overlay, tile_table
from vit_mnist.errors import CheckpointError, ConfigError, DataError, exit_on_user_error
from vit_mnist.models.vit import VisionTransformer
from vit_mnist.module import RUN_INFO_KEY
from vit_mnist.predict import IMAGE_SUFFIXES, UNREADABLE, load_model, mnist_preprocess
from vit_mnist.settings import ExploreSettings, check_settings

log = logging.getLogger(__name__)

ZOOM = 8  # screen pixels per image pixel of the 28 x 28 input and the explanation maps
TOP_K = 3  # classes in the prediction panel
LAUNCH_TRIES = 3
PREDICTED = -1  # the explanation dropdown's value for "the predicted class"
# The columns of eval.py's head_importance.csv (analysis=heads) that the head table shows,
# in this order; and those of its roles.csv (analysis=roles).
HEAD_TABLE_COLUMNS = (
    "layer",
    "head",
    "acc_drop",
    "loss_increase",
    "grad_importance",
    "entropy_nats",
    "mean_distance_px",
)
ROLE_TABLE_COLUMNS = ("layer", "head", "acc_drop", *ROLE_COLUMNS, "most_hurt_class")
# System fonts only: Gradio's default theme asks Google Fonts, which an offline machine
# cannot reach (the page then waits on it).
FONTS = ["ui-sans-serif", "system-ui", "sans-serif"]
MONO_FONTS = ["ui-monospace", "monospace"]


def original_heads(ckpt: dict[str, Any]) -> list[list[int]]:
    """Per block, the numbers its heads had before pruning (``[[0, 1, 2, 3], ...]`` for an
    unpruned model; for ``eval.py analysis=prune``'s ``pruned.ckpt`` its remaining heads,
    read from the ``pruned_heads`` it stores: ``"layer:head layer:head"`` per step)."""
    args = ckpt["hyper_parameters"]["model"]
    depth, counts = int(args["depth"]), args["num_heads"]
    counts = list(counts) if isinstance(counts, list | tuple) else [int(counts)] * depth
    removed: list[set[int]] = [set() for _ in range(depth)]
    for step in ckpt.get("pruned_heads", []):
        for pair in str(step).split():
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
    table = []
    for r in sorted(rows, key=lambda r: -float(r["acc_drop"])):
        values = [int(r["layer"]), int(r["head"]), round(100 * float(r["acc_drop"]), 3)]
        table.append(
            values + [r[c] if c == "most_hurt_class" else float(r[c]) for c in columns[3:]]
        )
    return ["layer", "head", "acc_drop (points)", *columns[3:]], table


@dataclass
class View:
    """What the page shows for one image and one choice of controls: pictures as
    (height, width, 3) uint8 arrays, texts, and the numbers they were drawn from."""

    explanation: ImageExplanation
    top: dict[str, float]
    summary: str
    seen: np.ndarray
    model_view: np.ndarray
    query_view: np.ndarray
    matrix: np.ndarray | None
    rollout: np.ndarray
    relevance: np.ndarray


def _array(picture: torch.Tensor) -> np.ndarray:
    """(3, H, W) uint8 or float in [0, 1] -> (H, W, 3) uint8, as Gradio shows it."""
    if picture.dtype != torch.uint8:
        picture = (picture.clamp(0, 1) * 255).round().to(torch.uint8)
    return picture.permute(1, 2, 0).contiguous().numpy()


def _zoomed(picture: torch.Tensor, zoom: int = ZOOM) -> torch.Tensor:
    """(N, 3, H, W) -> each pixel a zoom x zoom square."""
    return F.interpolate(picture.float(), scale_factor=zoom, mode="nearest")


@dataclass
class Explorer:
    """A checkpoint's model and what the page needs around it; the page's callbacks call
    :meth:`view` and the ``from_*`` readers, so tests can call them without a browser.

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

    def __post_init__(self) -> None:
        if not self.head_names:
            self.head_names = [list(range(b.attn.num_heads)) for b in self.model.blocks]

    # ------------------------------------------------------------------ inputs

    def from_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """(1, 28, 28) in [0, 1] (1 = ink) -> (1, 1, 28, 28) normalised, as trained."""
        return ((pixels - self.mean) / self.std)[None]

    def from_file(self, path: str | Path) -> torch.Tensor:
        """An uploaded image file, read as ``predict.py`` reads one (EXIF orientation,
        16-bit grey, PIL's decompression-bomb limit) and made MNIST-like.

        Raises:
            ValueError: the file cannot be decoded, holds no digit, or is not an image
                type ``predict.py`` reads; the message names the file.
        """
        path = Path(path)
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            raise ValueError(f"{path.name}: not one of {', '.join(IMAGE_SUFFIXES)}")
        try:
            with Image.open(path) as image:
                image.load()
                return self.from_pixels(mnist_preprocess(image))
        except UNREADABLE as e:
            raise ValueError(f"{path.name} cannot be read ({type(e).__name__}: {e})") from None

    def from_sketch(self, value: Any) -> torch.Tensor | None:
        """The sketchpad's drawing (Gradio's editor value: a dict whose ``composite`` is a
        PIL image, dark ink on a transparent or white canvas); None while it is blank."""
        image = value.get("composite") if isinstance(value, dict) else value
        if image is None:
            return None
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

    def view(
        self,
        x: torch.Tensor,
        *,
        heads_off: Sequence[tuple[int, int]] = (),
        target: int | None = None,
        layer: int = 0,
        token: int = 0,
        matrix_head: int | None = None,
        source: str = "",
    ) -> View:
        """Everything the page shows for image ``x`` (1, 1, 28, 28) normalised.

        Args:
            heads_off: (layer, head) pairs switched off, heads numbered within the block.
            target: the class the relevance explains; None or :data:`PREDICTED`: the
                predicted one.
            layer, token: the query view's layer and query token (0 = CLS, 1 = the
                distillation token of a distilled model, ``model.num_prefix_tokens + r *
                grid + c`` = patch (r, c)).
            matrix_head: the head (within ``layer``) whose full attention matrix is shown;
                None: none.
            source: where the image came from, for the summary line.
        """
        target = None if target is None or target == PREDICTED else int(target)
        e = explain_image(self.model, x, heads_off=heads_off, target=target)
        names = self.class_names
        p, c = e.probs.topk(min(TOP_K, len(e.probs)))
        top = {names[j]: float(q) for j, q in zip(c.tolist(), p.tolist(), strict=True)}
        image = x.float().cpu()
        base = int(e.base_probs.argmax())
        summary = f"predicted: {names[e.predicted]} ({100 * float(e.probs.max()):.1f}%)"
        if heads_off:
            before, after = 100 * float(e.base_probs[base]), 100 * float(e.probs[base])
            summary += (
                f"; {len(heads_off)} head{'s' * (len(heads_off) != 1)} off: "
                f"p({names[base]}) {before:.1f}% -> {after:.1f}% ({after - before:+.1f} points)"
            )
        if source:
            summary = f"{source}: {summary}"
        grid = e.grid_size
        rows, captions = [], []
        for lyr, maps in enumerate(e.cls_maps):
            heads = maps.shape[0]
            rows.append(overlay(image.expand(heads, -1, -1, -1), maps))
            captions.append(
                [
                    f"head {self.head_names[lyr][h]}{' OFF' if (lyr, h) in heads_off else ''}\n"
                    f"{float(e.entropy[lyr][h]):.2f} nats, {float(e.distance[lyr][h]):.1f} px"
                    for h in range(heads)
                ]
            )
        model_view = tile_table(
            rows, row_labels=[f"layer {lyr}" for lyr in range(len(rows))], captions=captions
        )
        layer = min(max(0, layer), len(e.weights) - 1)
        token = min(max(0, token), grid * grid)
        maps = e.token_maps(layer, token)
        heads = maps.shape[0]
        query_view = tile_table(
            [overlay(image.expand(heads, -1, -1, -1), maps)],
            row_labels=[f"layer {layer}"],
            captions=[[f"head {h}" for h in self.head_names[layer]]],
        )
        matrix = None
        if matrix_head is not None and 0 <= matrix_head < heads:
            w = e.weights[layer][matrix_head]
            scale = max(2, 400 // w.shape[-1])
            matrix = _array(_zoomed(colorize(w[None]), scale)[0])
        return View(
            explanation=e,
            top=top,
            summary=summary,
            seen=_array(self._seen(image, grid, token)),
            model_view=_array(model_view),
            query_view=_array(query_view),
            matrix=matrix,
            rollout=_array(_zoomed(overlay(image, e.rollout[None]))[0]),
            relevance=_array(_zoomed(overlay(image, e.relevance[None]))[0]),
        )

    @staticmethod
    def _seen(image: torch.Tensor, grid: int, token: int) -> torch.Tensor:
        """The 28 x 28 input, zoomed, with the patch grid and the query patch outlined."""
        picture = _zoomed(grey(image))[0]  # (3, 28 * ZOOM, 28 * ZOOM)
        step = picture.shape[-1] // grid
        picture[:, ::step, :] = picture[:, :, ::step] = 0.35
        if token > 0:
            r, c = divmod(token - 1, grid)
            box = picture[:, r * step : (r + 1) * step, c * step : (c + 1) * step]
            red = torch.tensor([1.0, 0.2, 0.2])[:, None, None]
            for edge in (box[:, :2], box[:, -2:], box[:, :, :2], box[:, :, -2:]):
                edge[:] = red
        return picture

    def token_at(self, x: float, y: float) -> int:
        """The query token of the patch under pixel (x, y) of the zoomed input picture."""
        grid = self.model.patch_embed.grid_size
        side = self.model.patch_embed.img_size * ZOOM
        r = min(grid - 1, max(0, int(y * grid // side)))
        c = min(grid - 1, max(0, int(x * grid // side)))
        return self.model.num_prefix_tokens + r * grid + c


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
    )
    heads_csv = cfg.get("heads_csv")
    if heads_csv:
        explorer.head_table = read_head_table(heads_csv)
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


# ---------------------------------------------------------------------------------- the page


def _gradio():
    """Gradio, imported with its telemetry off; a one-line error when it is missing."""
    # Read by Gradio when it is imported and when a page is launched: no usage reports,
    # no version check over the network.
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    try:
        import gradio as gr
    except ImportError:
        raise ConfigError(
            "the explorer needs Gradio: python -m pip install -e '.[explore]'"
        ) from None
    return gr


def build_page(explorer: Explorer):
    """The Gradio page (a ``gr.Blocks``) of ``explorer``; not launched.

    Every input (drawing, upload, test index, example, a click on a patch, a head's check
    box, a dropdown) calls :meth:`Explorer.view` once and updates every panel.
    """
    gr = _gradio()
    model = explorer.model
    grid = model.patch_embed.grid_size
    names = explorer.class_names
    prefix = model.num_prefix_tokens
    tokens = [("CLS", 0)] + [("distillation", 1)] * (prefix > 1)
    tokens += [(f"patch {r},{c}", prefix + r * grid + c) for r in range(grid) for c in range(grid)]

    def head_choices(layer: int) -> list[tuple[str, int]]:
        return [(f"head {n}", h) for h, n in enumerate(explorer.head_names[layer])]

    with gr.Blocks(title="vit-mnist attention explorer", analytics_enabled=False) as page:
        state = gr.State(None)  # {"x": (1, 1, 28, 28) normalised image, "source": str}
        gr.Markdown(
            f"### vit-mnist attention explorer\n`{explorer.title}`: {model.depth} layers, "
            f"heads per layer {[len(h) for h in explorer.head_names]}, patch "
            f"{model.patch_embed.patch_size}"
        )
        with gr.Row():
            with gr.Column(scale=3):
                with gr.Tabs():
                    with gr.Tab("Draw"):
                        sketch = gr.Sketchpad(
                            type="pil",
                            image_mode="RGBA",
                            canvas_size=(280, 280),
                            fixed_canvas=True,
                            layers=False,
                            brush=gr.Brush(default_size=22, colors=["#000000"]),
                            label="draw a digit (pick the brush on the left first)",
                        )
                    with gr.Tab("Upload"):
                        upload = gr.File(
                            file_types=list(IMAGE_SUFFIXES),
                            type="filepath",
                            label="an image",
                            elem_id="upload",
                        )
                    with gr.Tab("Test image"):
                        test_max = len(explorer.test_set) - 1 if explorer.test_set else 0
                        index = gr.Number(
                            label=f"test image index (0 to {test_max})",
                            precision=0,
                            minimum=0,
                            maximum=test_max,
                            interactive=explorer.test_set is not None,
                            elem_id="test-index",
                        )
                gallery = gr.Gallery(
                    value=(
                        [
                            (_array(_zoomed(grey(x[None]), 3)[0]), names[int(y)])
                            for x, y in zip(*explorer.examples, strict=True)
                        ]
                        if explorer.examples is not None
                        else []
                    ),
                    columns=5,
                    height=260,
                    object_fit="contain",
                    allow_preview=False,
                    label="examples: the TensorBoard panel's validation digits",
                    visible=explorer.examples is not None,
                )
            with gr.Column(scale=2):
                # Labels as text above the pictures: Gradio's label sits over the top of one.
                gr.Markdown("**What the model sees** (28 x 28): click a patch to query it")
                seen = gr.Image(show_label=False, interactive=False, format="png", elem_id="seen")
                prediction = gr.Label(num_top_classes=TOP_K, label="prediction")
                summary = gr.Markdown(elem_id="summary")
            with gr.Column(scale=3):
                target = gr.Dropdown(
                    [("the predicted class", PREDICTED)] + [(n, c) for c, n in enumerate(names)],
                    value=PREDICTED,
                    label="explain which class (class relevance, Chefer et al. 2021)",
                )
                with gr.Row():
                    rollout = gr.Image(
                        label="attention rollout", interactive=False, format="png", height=240
                    )
                    relevance = gr.Image(
                        label="class relevance", interactive=False, format="png", height=240
                    )
        gr.Markdown("**Heads on** (uncheck to switch a head off; every panel is recomputed)")
        with gr.Row():
            switches = [
                gr.CheckboxGroup(
                    head_choices(layer),
                    value=[h for _, h in head_choices(layer)],
                    label=f"layer {layer}",
                    elem_id=f"heads-layer-{layer}",
                    min_width=120,
                )
                for layer in range(model.depth)
            ]
        with gr.Row():
            with gr.Column(scale=1):
                gr.Markdown(
                    "**Model view**: the CLS token's attention of every layer (rows) and "
                    "head, its entropy and mean attention distance"
                )
                model_view = gr.Image(
                    show_label=False,
                    interactive=False,
                    format="png",
                    height=880,  # the whole grid, unscaled, for six layers of four heads
                    elem_id="model-view",
                )
            with gr.Column(scale=1):
                with gr.Row():
                    layer = gr.Dropdown(
                        [(f"layer {i}", i) for i in range(model.depth)],
                        value=0,
                        label="query view: layer",
                    )
                    token = gr.Dropdown(tokens, value=0, label="query token")
                query_view = gr.Image(
                    label="where the query token attends, per head",
                    interactive=False,
                    format="png",
                )
                matrix_head = gr.Dropdown(
                    [("none", -1), *head_choices(0)],
                    value=-1,
                    label="full attention matrix of head (row = query, column = key, 0 = CLS)",
                )
                matrix = gr.Image(label="attention matrix", interactive=False, format="png")
        if explorer.head_table is not None:
            headers, rows = explorer.head_table
            with gr.Accordion("heads by importance (eval.py analysis=heads or roles)", open=False):
                gr.Dataframe(value=rows, headers=headers, interactive=False)

        controls = [target, layer, token, matrix_head, *switches]
        outputs = [prediction, summary, seen, model_view, query_view, matrix, rollout, relevance]

        def show(current, target_v, layer_v, token_v, head_v, *checked) -> list[Any]:
            if current is None:
                return [gr.skip()] * len(outputs)
            v = explorer.view(
                current["x"],
                heads_off=explorer.heads_off(checked),
                target=target_v,
                layer=int(layer_v or 0),
                token=int(token_v or 0),
                matrix_head=None if head_v is None or int(head_v) < 0 else int(head_v),
                source=current["source"],
            )
            return [
                v.top,
                v.summary,
                v.seen,
                v.model_view,
                v.query_view,
                v.matrix,
                v.rollout,
                v.relevance,
            ]

        def new_input(read):
            """A handler that reads a new image with ``read(value) -> (x, source)`` and
            shows it; a bad input is a warning on the page and changes nothing."""

            def handler(value, *values):
                try:
                    found = read(value)
                except ValueError as e:
                    gr.Warning(str(e))
                    found = None
                if found is None:
                    return [gr.skip()] * (1 + len(outputs))
                current = {"x": found[0], "source": found[1]}
                return [current, *show(current, *values)]

            return handler

        def read_sketch(value):
            x = explorer.from_sketch(value)
            return None if x is None else (x, "drawing")

        def read_upload(path):
            return None if not path else (explorer.from_file(path), Path(path).name)

        def read_test(i):
            if i is None:
                return None
            x, label = explorer.from_test(int(i))
            return x, f"test image {int(i)} (label {names[label]})"

        # Gradio finds the event's data by the parameter's annotation, which must be the
        # class itself (this module's annotations are strings).
        def read_example(i):
            x, y = explorer.examples[0][i : i + 1], int(explorer.examples[1][i])
            return x, f"example {i} (label {names[y]})"

        def pick_example(_, evt, *values):
            return new_input(read_example)(evt.index, *values)

        def first_example(*values):
            # The page opens on the first example, not on empty panels.
            if explorer.examples is None:
                return [gr.skip()] * (1 + len(outputs))
            return new_input(read_example)(0, *values)

        pick_example.__annotations__ = {"evt": gr.SelectData}
        both = [state, *outputs]
        sketch.change(new_input(read_sketch), [sketch, *controls], both, show_progress="hidden")
        upload.upload(new_input(read_upload), [upload, *controls], both)
        index.input(new_input(read_test), [index, *controls], both, show_progress="hidden")
        gallery.select(pick_example, [gallery, *controls], both, show_progress="hidden")
        page.load(first_example, controls, both, show_progress="hidden")

        def click(current, evt, *values):
            chosen = explorer.token_at(*evt.index)
            return [chosen, *show(current, *values[:2], chosen, *values[3:])]

        click.__annotations__ = {"evt": gr.SelectData}

        seen.select(click, [state, *controls], [token, *outputs], show_progress="hidden")

        def new_layer(current, *values):
            choices = [("none", -1), *head_choices(int(values[1]))]
            return [
                gr.update(choices=choices, value=-1),
                *show(current, *values[:3], -1, *values[4:]),
            ]

        layer.input(new_layer, [state, *controls], [matrix_head, *outputs], show_progress="hidden")
        for control in (target, token, matrix_head, *switches):
            control.input(show, [state, *controls], outputs, show_progress="hidden")
    return page


def launch(
    page,
    *,
    server_name: str = "127.0.0.1",
    server_port: int | None = None,
    max_upload_mb: float = 10.0,
) -> str:
    """Start ``page`` in a background thread; returns its address (``http://host:port/``).

    Telemetry off, Gradio's footer links (API, settings) off, uploads over
    ``max_upload_mb`` refused, nothing served beyond Gradio's own cache of the pictures
    (``allowed_paths`` stays empty).
    """
    gr = _gradio()
    theme = gr.themes.Default(font=FONTS, font_mono=MONO_FONTS)
    for attempt in range(LAUNCH_TRIES):
        try:
            _, url, _ = page.launch(
                server_name=server_name,
                server_port=server_port,
                prevent_thread_lock=True,
                quiet=True,
                share=False,
                inbrowser=False,
                max_file_size=int(max_upload_mb * 1024 * 1024),  # bytes
                footer_links=[],
                ssr_mode=False,
                mcp_server=False,
                theme=theme,
            )
            return url
        except ValueError as e:
            # Gradio asks its own new server for the page once, with a 3 s timeout, and
            # gives up when a busy machine answers later: the server is closed and started
            # again.
            if "localhost is not accessible" not in str(e) or attempt == LAUNCH_TRIES - 1:
                raise
            log.warning("the page did not answer in time; starting it again")
            page.close()


@exit_on_user_error
def main(cfg: DictConfig) -> None:
    """The body of ``python scripts/explore.py ckpt_path=PATH``: start the page, print its
    address, serve until Ctrl-C.

    Raises:
        CheckpointError: no or an unreadable checkpoint (exit status 2).
        ConfigError: a bad setting, an unreadable ``heads_csv``, no Gradio (exit status 2).
    """
    if OmegaConf.is_missing(cfg, "ckpt_path"):
        raise CheckpointError("ckpt_path is required: scripts/explore.py ckpt_path=PATH")
    check_settings(cfg, ExploreSettings)
    # One image at a time: a second thread only waits on the first, and on a shared
    # machine it competes with everything else for the cores.
    torch.set_num_threads(1)
    explorer = load_explorer(cfg)
    page = build_page(explorer)
    # Gradio's requests to its own server are logged by httpx at INFO: not the user's news.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    url = launch(
        page,
        server_name=cfg.server_name,
        server_port=cfg.server_port,
        max_upload_mb=float(cfg.max_upload_mb),
    )
    print(f"explorer: {url} (Ctrl-C stops it)", flush=True)
    try:
        page.block_thread()
    finally:
        page.close()
