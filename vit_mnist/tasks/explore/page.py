"""The explorer's page (Gradio), built panel by panel: each ``_*_panel`` function lays out
one part of the page and returns its components; :class:`Handlers` answers the page's
events with :class:`~vit_mnist.tasks.explore.session.Explorer`'s computations; and
:func:`build_page` puts the panels together and wires the events to the handlers.

The page only lays out and calls: every number and picture comes from the session.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vit_mnist.analysis import drawing
from vit_mnist.data.images import IMAGE_SUFFIXES
from vit_mnist.errors import ConfigError, WriteError
from vit_mnist.tasks.explore.session import (
    CANVAS_SIDE,
    PREDICTED,
    TOP_K,
    Explorer,
    View,
    picture_array,
    zoomed,
)

# The colour scale's choices; the first is the default.
SCALES = ("each map", "shared")
# The Draw tab's canvas, the page's own (Gradio's HTML component): at the pointer's release
# the drawing goes with the event, one PNG data URL in one request. Gradio's Sketchpad
# renders and uploads three PNGs first, about a second a stroke in headless Chromium on a
# 2-core CPU, over the 500 ms asked (docs/explorer.md).
INK_WIDTH = 22  # px
SKETCH_HTML = (
    "<p>draw one digit, about as tall as the box</p>"
    f'<canvas width="{CANVAS_SIDE}" height="{CANVAS_SIDE}" data-ink="{INK_WIDTH}" role="img" '
    'aria-label="a canvas: draw one digit with the mouse, a pen or a finger"></canvas>'
    '<button type="button">Clear canvas</button>'
)
SKETCH_CSS = (
    "canvas { display: block; background: white; border: 1px solid #bbb; "
    "touch-action: none; cursor: crosshair; } button { margin-top: 6px; padding: 2px 10px; } "
    "p { margin: 0 0 4px; color: #555; }"
)
# Uploads, drawings and the pictures sent to the browser live in Gradio's cache folder;
# Gradio deletes those older than this every as many seconds, and all when the page closes.
CACHE_MAX_AGE_S = 3600
DRAWING = "drawing"  # the source of an image drawn on the page


def import_gradio():
    """Gradio, imported with its telemetry off.

    Raises:
        ConfigError: Gradio is not installed (the ``explore`` extra).
    """
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


def _uploads_only(gr, move: Callable[[Any], Awaitable[str | None]]):
    """``move`` (a component's ``async_move_resource_to_block_cache``), refusing a URL
    with one line on the page, and none in the terminal."""
    from gradio_client.utils import is_http_url_like

    async def moved(url_or_path):
        if url_or_path is not None and is_http_url_like(str(url_or_path)):
            raise gr.Error(
                "the explorer takes files as uploads only, not URLs", print_exception=False
            )
        return await move(url_or_path)

    return moved


def _image(gr, title: str, alt: str, elem_id: str):
    """A picture under its title: the title as text above it, not Gradio's label, which
    covers its top left corner; no Share button (it only says "Must be on Spaces")."""
    gr.Markdown(title)
    return gr.Image(
        show_label=False,
        interactive=False,
        format="png",
        buttons=["download", "fullscreen"],
        alt_text=alt,
        elem_id=elem_id,
    )


def _head_choices(explorer: Explorer, layer: int) -> list[tuple[str, int]]:
    """The heads of block ``layer`` as (name in the unpruned model, index) choices."""
    return [(f"head {n}", h) for h, n in enumerate(explorer.head_names[layer])]


# Gradio's gallery grid gives each tile at least 100 px: its 5 columns overflowed the input
# column, and at 1 400 px wide the 4 and the 9 were cut off. The tiles share the width.
PAGE_CSS = (
    "#examples .grid-container { grid-template-columns: repeat(5, minmax(0, 1fr)) !important;"
    " grid-auto-rows: auto !important; padding-top: 32px !important; }"
    " #examples .gallery-item, #examples .thumbnail-item { height: auto; aspect-ratio: 1; }"
)


def _input_panel(gr, explorer: Explorer) -> dict[str, Any]:
    """The input: the Draw, Upload and Test image tabs, and the examples below them."""
    names = explorer.class_names
    examples = [
        (picture_array(zoomed(drawing.grey(x[None]), 3)[0]), names[int(y)])
        for x, y in zip(*(explorer.examples or ([], [])), strict=True)
    ]
    with gr.Tabs():
        with gr.Tab("Draw"):
            sketch = gr.HTML(
                html_template=SKETCH_HTML,
                css_template=SKETCH_CSS,
                js_on_load=Path(__file__).with_name("sketch.js").read_text(),
                elem_id="sketch",
            )
        with gr.Tab("Upload"):
            upload = gr.File(
                file_types=list(IMAGE_SUFFIXES),
                type="filepath",
                label=(
                    "an image (PNG, JPEG, BMP or WebP; at most "
                    f"{explorer.max_megapixels:g} megapixels)"
                ),
                elem_id="upload",
            )
        with gr.Tab("Test image"):
            test_max = len(explorer.test_set) - 1 if explorer.test_set else 0
            # No minimum or maximum: Gradio's own check of them prints a traceback;
            # Explorer.from_test says the range on the page.
            index = gr.Number(
                label=f"test image index (0 to {test_max})",
                precision=0,
                interactive=explorer.test_set is not None,
                elem_id="test-index",
            )
    gallery = gr.Gallery(
        value=examples,
        columns=5,
        elem_id="examples",
        object_fit="contain",
        allow_preview=False,
        interactive=False,
        buttons=[],
        label="examples: the TensorBoard panel's validation digits",
        visible=explorer.examples is not None,
    )
    return dict(sketch=sketch, upload=upload, index=index, gallery=gallery)


def _prediction_panel(gr, explorer: Explorer) -> dict[str, Any]:
    """What the model sees, its prediction, and the view's saving."""
    seen = _image(
        gr,
        "**What the model sees** (28 x 28): click a patch to query it",
        "the input digit as the model sees it, 28 x 28, with the patch grid and "
        "the query patch outlined in red",
        "seen",
    )
    prediction = gr.Label(num_top_classes=TOP_K, label="prediction")
    summary = gr.Markdown(elem_id="summary")
    save = gr.Button("save this view", visible=explorer.run_dir is not None, elem_id="save")
    saved = gr.Markdown(elem_id="saved")
    return dict(seen=seen, prediction=prediction, summary=summary, save=save, saved=saved)


def _explanation_panel(gr, explorer: Explorer) -> dict[str, Any]:
    """The class to explain, its attention rollout and class relevance."""
    names = explorer.class_names
    target = gr.Dropdown(
        [("the predicted class", PREDICTED)] + [(n, c) for c, n in enumerate(names)],
        value=PREDICTED,
        label="explain which class (class relevance, Chefer et al. 2021)",
    )
    with gr.Row():
        with gr.Column(min_width=160):
            rollout = _image(
                gr,
                "**Attention rollout** (Abnar and Zuidema 2020)",
                "attention rollout over the digit: how much of each patch "
                "reaches the CLS token through all layers",
                "rollout",
            )
        with gr.Column(min_width=160):
            relevance = _image(
                gr,
                "**Class relevance** (Chefer et al. 2021)",
                "class relevance over the digit: which patches speak for the explained class",
                "relevance",
            )
    return dict(target=target, rollout=rollout, relevance=relevance)


def _heads_panel(gr, explorer: Explorer) -> dict[str, Any]:
    """A checkbox per head of each layer, and the colour scale with its legend."""
    gr.Markdown("**Heads on** (uncheck to switch a head off; every panel is recomputed)")
    with gr.Row():
        switches = [
            gr.CheckboxGroup(
                _head_choices(explorer, layer),
                value=[h for _, h in _head_choices(explorer, layer)],
                label=f"layer {layer}",
                elem_id=f"heads-layer-{layer}",
                min_width=120,
            )
            for layer in range(explorer.model.depth)
        ]
    with gr.Row():
        scale = gr.Radio(
            list(SCALES), value=SCALES[0], label="colour scale", elem_id="scale", scale=1
        )
        gr.Markdown(
            "**Colours** run from the colour bar's left end (dark) to its right end (bright). "
            "With *each map*, every map is scaled to its own minimum and maximum, so a head "
            "that attends almost evenly looks as vivid as a sharp one; with *shared*, all maps "
            "of a panel share one scale from 0 to the panel's largest value."
        )
    return dict(switches=switches, scale=scale)


def _query_controls(gr, explorer: Explorer) -> dict[str, Any]:
    """The query view's layer and query token."""
    model = explorer.model
    prefix, grid = model.num_prefix_tokens, model.patch_embed.grid_size
    tokens = [("CLS", 0), ("distillation", 1)][:prefix]
    tokens += [(explorer._name(t), t) for t in range(prefix, prefix + grid**2)]
    with gr.Row():
        layer = gr.Dropdown(
            [(f"layer {i}", i) for i in range(model.depth)], value=0, label="query view: layer"
        )
        token = gr.Dropdown(tokens, value=0, label="query token")
    return dict(layer=layer, token=token)


def _attention_panel(gr, explorer: Explorer) -> dict[str, Any]:
    """The model view of every layer and head; the query view of one layer and token, and
    one head's full attention matrix."""
    with gr.Row():
        with gr.Column(scale=1):
            model_view = _image(
                gr,
                "**Model view**: the CLS token's attention of every layer (rows) and head, "
                "its entropy and mean attention distance; a head switched off is crossed out",
                "the model view: a grid of layers by heads, each tile the CLS token's "
                "attention over the digit, with its entropy and mean distance",
                "model-view",
            )
        with gr.Column(scale=1):
            query = _query_controls(gr, explorer)
            query_view = _image(
                gr,
                "**Where the query token attends**, per head",
                "the query view: per head of the chosen layer, where the query token "
                "attends over the digit",
                "query-view",
            )
            matrix_head = gr.Dropdown(
                [("none", -1), *_head_choices(explorer, 0)],
                value=-1,
                label="full attention matrix of head",
                elem_id="matrix-head",
            )
            matrix = _image(
                gr,
                "**Attention matrix**: rows are queries, columns keys",
                "the chosen head's full attention matrix, tokens CLS and patch row,column "
                "along both sides",
                "matrix",
            )
    return dict(
        model_view=model_view,
        **query,
        query_view=query_view,
        matrix_head=matrix_head,
        matrix=matrix,
    )


def _circuits_panel(gr, explorer: Explorer) -> dict[str, Any]:
    """What each head writes into the logits, the logit lens, and the head table."""
    with gr.Row():
        with gr.Column(scale=1):
            writes = _image(
                gr,
                "**What each head writes**: its output's direct contribution to the predicted "
                "class's logit, and to the margin over the class chosen above (else the "
                "runner-up): *why this class and not that one* (direct logit attribution, "
                "Elhage et al. 2021; `eval.py analysis=circuits` for the whole test set)",
                "two tables of layers by heads: each head's direct contribution to the "
                "predicted class's logit, and to its margin over the other class",
                "writes",
            )
        with gr.Column(scale=1):
            gr.Markdown(
                "**Logit lens**: the probability of the predicted class and of the class "
                "it is compared with (the one chosen above, else the runner-up), read "
                "from the CLS token after each block (nostalgebraist 2020)"
            )
            lens = gr.LinePlot(
                x="after block",
                y="probability %",
                color="line",
                color_title="class",
                sort=[str(b) for b in range(explorer.model.depth)],  # whole blocks, in order
                y_lim=[0, 100],
                show_label=False,
                elem_id="lens",
            )
    if explorer.head_table is not None:
        headers, rows = explorer.head_table
        with gr.Accordion("heads by importance (eval.py analysis=heads or roles)", open=False):
            gr.Dataframe(value=rows, headers=headers, interactive=False)
    return dict(writes=writes, lens=lens)


def build_page(explorer: Explorer):
    """The Gradio page (a ``gr.Blocks``) of ``explorer``; not launched.

    A new image, a head switched on or off and a new class to explain run the model once
    (:meth:`Explorer.view`) and update every panel; the colour scale redraws them from the
    session's last explanation, and a patch, query token, layer or matrix head redraws the
    query view alone (:meth:`Explorer.query`), without the model.

    Raises:
        ConfigError: Gradio is not installed.
    """
    gr = import_gradio()
    model = explorer.model
    with gr.Blocks(
        title="vit-mnist attention explorer",
        analytics_enabled=False,
        delete_cache=(CACHE_MAX_AGE_S, CACHE_MAX_AGE_S),
    ) as page:
        gr.Markdown(
            f"### vit-mnist attention explorer\n`{explorer.title}`: {model.depth} layers, "
            f"heads per layer {[len(h) for h in explorer.head_names]}, patch "
            f"{model.patch_embed.patch_size}"
        )
        with gr.Row():
            with gr.Column(scale=3):
                inputs = _input_panel(gr, explorer)
            with gr.Column(scale=2):
                prediction = _prediction_panel(gr, explorer)
            with gr.Column(scale=3):
                explanation = _explanation_panel(gr, explorer)
        c = SimpleNamespace(
            # The session's own: see Handlers.
            state=gr.State(None),
            **inputs,
            **prediction,
            **explanation,
            **_heads_panel(gr, explorer),
            **_attention_panel(gr, explorer),
            **_circuits_panel(gr, explorer),
        )
        _wire(gr, page, Handlers(gr, explorer, c), c)
    return page


def _wire(gr, page, h: Handlers, c: SimpleNamespace) -> None:
    """Each event of the page's components ``c`` to its handler in ``h``."""
    # Gradio finds the event's data by the parameter's annotation, which must be the
    # class itself (this module's annotations are strings).
    Handlers.pick_example.__annotations__ = {"evt": gr.SelectData}
    Handlers.drawn.__annotations__ = {"evt": gr.EventData}
    Handlers.click.__annotations__ = {"evt": gr.SelectData}
    # Files only as uploads: Gradio fetches a URL that an API request names as the file
    # of an input; the upload refuses it before anything is fetched.
    c.upload.async_move_resource_to_block_cache = _uploads_only(
        gr, c.upload.async_move_resource_to_block_cache
    )
    controls, session, shown, queried = h.controls, h.session, h.shown, h.queried
    # No spinner over the panels; and a change made while the last one is computed is
    # shown after it (Gradio's default for these events drops it, leaving panels that do
    # not match the controls).
    quiet = {"show_progress": "hidden", "trigger_mode": "always_last"}
    c.sketch.input(h.drawn, session, shown, **quiet)
    c.upload.upload(
        h.new_input(h.read_upload), [c.upload, *controls], shown, trigger_mode="always_last"
    )
    c.index.input(h.new_input(h.read_test), [c.index, *controls], shown, **quiet)
    c.gallery.select(h.pick_example, controls, shown, **quiet)
    page.load(h.first_example, controls, shown, **quiet)
    for control in (c.target, c.scale, *c.switches):
        control.input(h.show, session, shown, **quiet)
    c.seen.select(h.click, session, [c.token, *queried], **quiet)
    for control in (c.token, c.matrix_head):
        control.input(h.requery, session, queried, **quiet)
    c.layer.input(h.new_layer, session, [c.matrix_head, *queried], **quiet)
    c.save.click(h.save_view, session, c.saved)


class Handlers:
    """The page's event handlers for the components ``c``, calling ``explorer``.

    A session's state (a ``gr.State``, one per browser tab) is None before an image, else
    ``{"x": (1, 1, 28, 28) normalised image, "source": str, "key": (heads off, class) of
    "explanation", the last Explorer.explain of x}``. A handler takes the state and the
    controls' values (:attr:`controls`, in that order) and returns the state and the panels'
    new values (:attr:`shown`), or the query view's (:attr:`queried`).
    """

    def __init__(self, gr, explorer: Explorer, c: SimpleNamespace) -> None:
        self.gr, self.explorer = gr, explorer
        self.controls = [c.target, c.scale, c.layer, c.token, c.matrix_head, *c.switches]
        self.session = [c.state, *self.controls]
        # The View's fields and the components that show them: a new panel is a field of
        # View and a line here.
        self.panels = {
            "top": c.prediction,
            "summary": c.summary,
            "seen": c.seen,
            "model_view": c.model_view,
            "query_view": c.query_view,
            "matrix": c.matrix,
            "rollout": c.rollout,
            "relevance": c.relevance,
            "writes": c.writes,
            "lens": c.lens,
        }
        self.shown = [c.state, *self.panels.values()]
        self.queried = [c.seen, c.query_view, c.matrix]
        self.show_example = self.new_input(self.read_example)

    def choices(self, values: Sequence[Any], **changed: Any) -> dict[str, Any]:
        """The controls' values as :meth:`Explorer.view`'s arguments, with ``changed``."""
        target_v, scale_v, layer_v, token_v, head_v, *checked = values
        return {
            "heads_off": self.explorer.heads_off(checked),
            "target": target_v,
            "layer": int(layer_v or 0),
            "token": int(token_v or 0),
            "matrix_head": None if head_v is None or int(head_v) < 0 else int(head_v),
            "shared": scale_v == SCALES[1],
            **changed,
        }

    def explained(self, current: dict, values: Sequence[Any], **changed: Any) -> tuple[dict, dict]:
        """``current`` with the explanation of its image for :meth:`choices`, the last one
        if it was for the same heads and class, else the model is run; and the choices."""
        chosen = self.choices(values, **changed)
        key = (tuple(chosen["heads_off"]), chosen["target"])
        if current.get("key") != key:
            e = self.explorer.explain(current["x"], chosen["heads_off"], chosen["target"])
            current = {**current, "key": key, "explanation": e}
        return current, chosen

    def viewed(self, current: dict, values: Sequence[Any]) -> tuple[dict, View]:
        """The session's state and its :class:`View` for the controls' values."""
        current, chosen = self.explained(current, values)
        x, e, source = current["x"], current["explanation"], current["source"]
        return current, self.explorer.view(x, explanation=e, source=source, **chosen)

    def show(self, current, *values) -> list[Any]:
        """[state, *panels] for the session's image (None: unchanged) and the controls'
        values."""
        if current is None:
            return [self.gr.skip()] * len(self.shown)
        current, v = self.viewed(current, values)
        return [current, *(getattr(v, name) for name in self.panels)]

    def requery(self, current, *values, **changed) -> list[Any]:
        """The query view's pictures from the session's explanation."""
        if current is None:
            return [self.gr.skip()] * len(self.queried)
        current, chosen = self.explained(current, values, **changed)
        kept = {k: chosen[k] for k in ("layer", "token", "matrix_head", "shared")}
        return list(self.explorer.query(current["explanation"], current["x"], **kept))

    def new_input(self, read):
        """A handler that shows the new session state ``read(value)`` returns; None or a
        bad input (a warning on the page) changes nothing."""

        def handler(value, *values):
            try:
                current = read(value)
            except ValueError as e:
                self.gr.Warning(str(e))
                current = None
            return self.show(current, *values)

        return handler

    def drawn(self, evt, current, *values):
        """A stroke shows the drawing; a canvas cleared while the panels show the drawing
        empties them."""
        try:
            sent = evt._data if isinstance(evt._data, dict) else {}  # what the canvas sent
            x = self.explorer.from_sketch(sent.get("png"))
        except ValueError as e:
            self.gr.Warning(str(e))
            return self.show(None)
        if x is not None:
            return self.show({"x": x, "source": DRAWING}, *values)
        if current is not None and current["source"] == DRAWING:
            return [None, *("" if name == "summary" else None for name in self.panels)]
        return self.show(None)

    def read_upload(self, path):
        return {"x": self.explorer.from_file(path), "source": Path(path).name} if path else None

    def read_test(self, i):
        if i is None:
            return None
        x, label = self.explorer.from_test(int(i))
        return {"x": x, "source": f"test image {int(i)} (label {self.explorer.class_names[label]})"}

    def read_example(self, i):
        examples = self.explorer.examples
        if examples is None:
            return None
        label = self.explorer.class_names[int(examples[1][i])]
        return {"x": examples[0][i : i + 1], "source": f"example {i} (label {label})"}

    def pick_example(self, evt, *values):
        return self.show_example(evt.index, *values)

    def first_example(self, *values):
        # The page opens on the first example, not on empty panels.
        return self.show_example(0, *values)

    def click(self, current, evt, *values):
        patch = self.explorer.token_at(*evt.index)
        return [patch, *self.requery(current, *values, token=patch)]

    def new_layer(self, current, *values):
        choices = [("none", -1), *_head_choices(self.explorer, int(values[2]))]
        return [
            self.gr.update(choices=choices, value=-1),
            *self.requery(current, *values, matrix_head=None),
        ]

    def save_view(self, current, *values):
        if current is None:
            return "nothing to save yet"
        current, v = self.viewed(current, values)
        try:
            path = self.explorer.save(v, current["x"])
        except WriteError as e:
            return f"not saved: {e}"
        return f"saved: `{path}` and its settings, `{path.with_suffix('.json').name}`"
