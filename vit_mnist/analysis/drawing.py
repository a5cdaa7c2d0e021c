"""Pictures as uint8 tensors for TensorBoard and PNG files: colour maps, overlays, grids."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange
from matplotlib import colormaps
from PIL import Image, ImageDraw, ImageFont
from torchvision.transforms.functional import pil_to_tensor, to_pil_image
from torchvision.utils import make_grid


@lru_cache(maxsize=4)
def _colormap(name: str) -> torch.Tensor:
    return torch.from_numpy(colormaps[name](np.linspace(0, 1, 256))[:, :3]).float()


def _lookup(unit: torch.Tensor, cmap: str) -> torch.Tensor:
    """(N, H, W) in [0, 1] -> (N, 3, H, W) RGB: the nearest of the colour map's 256 colours."""
    return rearrange(_colormap(cmap)[(unit * 255).round().long().cpu()], "n h w c -> n c h w")


def _unit(x: torch.Tensor, low: float | None = None, high: float | None = None) -> torch.Tensor:
    """Scale (N, ...) to [0, 1]: each leading item from its own minimum to its own maximum,
    or, given ``low`` and ``high``, every item from ``low`` to ``high`` (clipped)."""
    flat = x.flatten(1)
    if low is None or high is None:
        lo, hi = flat.min(dim=1, keepdim=True).values, flat.max(dim=1, keepdim=True).values
    else:
        lo, hi = torch.tensor(float(low)), torch.tensor(float(high))
    return ((flat - lo) / (hi - lo).clamp_min(1e-12)).clamp(0, 1).view_as(x)


def _pixels(tiles: torch.Tensor, zoom: int) -> torch.Tensor:
    """(N, 3, H, W) float in [0, 1] -> (N, 3, H * zoom, W * zoom) uint8, each pixel a square."""
    big = F.interpolate(tiles.float(), scale_factor=zoom, mode="nearest")
    return big.clamp(0, 1).mul(255).round().to(torch.uint8)


def colorize(
    values: torch.Tensor,
    cmap: str = "inferno",
    *,
    low: float | None = None,
    high: float | None = None,
) -> torch.Tensor:
    """Map (N, H, W) values to (N, 3, H, W) RGB in [0, 1]: each item scaled to its own range,
    or all from ``low`` (the colour map's first colour) to ``high`` (its last) when given."""
    return _lookup(_unit(values.float(), low, high), cmap)


def diverging(values: torch.Tensor, limit: float, cmap: str = "RdBu_r") -> torch.Tensor:
    """Map (N, H, W) values to (N, 3, H, W) RGB in [0, 1] on one scale shared by all items:
    ``-limit`` and below full blue, 0 white, ``+limit`` and above full red; NaN grey."""
    unit = ((values.float() / max(limit, 1e-12)).clamp(-1, 1) + 1) / 2
    rgb = _lookup(unit.nan_to_num(0.5), cmap)
    return torch.where(values.isnan().cpu()[:, None], torch.tensor(0.73), rgb)


def grey(images: torch.Tensor) -> torch.Tensor:
    """(N, 1, H, W) images of any normalisation -> (N, 3, H, W) grey in [0, 1]."""
    return _unit(images.float().cpu()).expand(-1, 3, -1, -1)


def overlay(
    images: torch.Tensor,
    maps: torch.Tensor,
    alpha: float = 0.6,
    cmap: str = "inferno",
    *,
    low: float | None = None,
    high: float | None = None,
) -> torch.Tensor:
    """Overlay attention maps in colour on grey images, as what they are: one flat block
    per token (nearest-neighbour; a smooth upsampling would suggest a finer resolution
    than the tokens have), with the token grid drawn as thin darker lines.

    Args:
        images: (N, 1, H, W) float, any normalisation (each is min-max scaled).
        maps: (N, g, g) attention over the patch grid; each value fills its token's
            (H / g) x (W / g) pixels.
        alpha: weight of the colour.
        low, high: the values of the colour map's ends, shared by every map; None: each
            map from its own minimum to its own maximum.

    Returns:
        (N, 3, H, W) float in [0, 1].
    """
    h, w = images.shape[-2:]
    up = F.interpolate(maps[:, None].float(), size=(h, w), mode="nearest")
    colours = colorize(up[:, 0].cpu(), cmap, low=low, high=high)
    picture = (1 - alpha) * grey(images) + alpha * colours
    # The first pixel row and column of every token but the first row and column: the
    # lines between tokens, darkened by a quarter (the digit still shows through them).
    token_row = torch.arange(h) * maps.shape[-2] // h  # the token row of each pixel row
    token_col = torch.arange(w) * maps.shape[-1] // w
    row_edge = torch.cat([torch.tensor([False]), token_row[1:] != token_row[:-1]])
    col_edge = torch.cat([torch.tensor([False]), token_col[1:] != token_col[:-1]])
    return torch.where(row_edge[:, None] | col_edge[None, :], 0.75 * picture, picture)


def crossed_out(images: torch.Tensor, width: int = 2) -> torch.Tensor:
    """(N, 1, H, W) images of any normalisation -> (N, 3, H, W) in [0, 1]: the image faded
    and crossed corner to corner in red, for a map that is not in use (a head switched
    off)."""
    faded = 0.7 + 0.3 * grey(images)
    h, w = faded.shape[-2:]
    rows = torch.arange(h)[:, None] * (w / h)
    cols = torch.arange(w)[None, :]
    cross = ((rows - cols).abs() < width) | ((rows + cols - (w - 1)).abs() < width)
    red = torch.tensor([0.8, 0.1, 0.1])[:, None, None]
    return torch.where(cross, red, faded)


# ----------------------------------------------------------------------------- text

#: TensorBoard shows an image scaled to the width of its card: 350 CSS px in the Images
#: tab (``tf-image-loader``: ``:host { width: 350px }``, ``img { width: 100% }``) and at
#: least 335 px in Time Series (``minmax(335px, 1fr)`` columns, less the card's padding).
#: Labels are sized for a card this wide, a little narrower than both, so that they stay
#: readable at TensorBoard's default card size.
CARD_WIDTH = 320
#: Height of a capital letter, in screen pixels, once the picture is CARD_WIDTH wide.
CAP_HEIGHT = 10


class _Font:
    """Aileron Regular, Pillow's built-in scalable font, at ``size`` px.

    ``load_default(size=...)`` needs Pillow >= 10.1 with FreeType, which every Pillow wheel
    ships; a Pillow built without it raises ImportError here.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.font = ImageFont.load_default(size=size)
        # One line box for every text, from the top of the tallest glyph to the bottom of
        # the lowest, so that labels side by side share a baseline.
        _, self.top, _, bottom = self.font.getbbox("Hg(>|")
        self.line_height = bottom - self.top
        # FreeType's box of a capital H is the box of its ink (checked for sizes 1 to 300).
        _, cap_top, _, cap_bottom = self.font.getbbox("H")
        self.cap_height = cap_bottom - cap_top
        self.cap_middle = cap_top - self.top + self.cap_height // 2

    def width(self, text: str) -> int:
        """Width in px of the ink of ``text``."""
        if not text.strip():
            return 0
        left, _, right, _ = self.font.getbbox(text)
        return right - left

    def draw(self, canvas: Image.Image, xy: tuple[int, int], text: str) -> None:
        """Draw ``text`` in black, the top-left corner of its line box at ``xy``."""
        origin = (xy[0] - self.font.getbbox(text)[0], xy[1] - self.top)
        ImageDraw.Draw(canvas).text(origin, text, fill="black", font=self.font)


#: How wide a text is set in a font: its ink (_Font.width) or its glyphs' advances.
_Measure = Callable[[_Font, str], int]


@lru_cache(maxsize=64)
def _font_of_size(size: int) -> _Font:
    return _Font(size)


def _font(cap_height: float) -> _Font:
    """The smallest font whose capital letters are at least ``cap_height`` px high."""
    size = max(1, math.floor(cap_height))
    while _font_of_size(size).cap_height < cap_height:
        size += 1
    return _font_of_size(size)


def _fitting(
    font: _Font, texts: Iterable[str], width: int, measure: _Measure = _Font.width
) -> _Font:
    """``font``, or the largest smaller one in which each of ``texts`` is at most ``width``
    px wide (size 1 if none is)."""
    widest = max(texts, key=lambda text: measure(font, text), default="")
    size = font.size
    while size > 1 and measure(_font_of_size(size), widest) > width:
        size -= 1
    return _font_of_size(size)


def _wrap(font: _Font, text: str, width: int, measure: _Measure = _Font.width) -> list[str]:
    """``text`` broken at spaces into lines at most ``width`` px wide (but a word that is
    wider than that stays whole)."""
    lines: list[str] = []
    for word in text.split():
        if lines and measure(font, f"{lines[-1]} {word}") <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    return lines


def _label_font(width: int, card_width: int) -> _Font:
    """The font for the labels of a picture ``width`` px wide, readable once it is scaled
    to ``card_width`` (capitals CAP_HEIGHT screen px high)."""
    return _font(CAP_HEIGHT * max(width, card_width) / card_width)


@lru_cache(maxsize=512)
def _glyph(font: _Font, char: str) -> tuple[Image.Image, int]:
    """One character of ``font`` as a mask one line box high, and its advance in px."""
    advance = round(font.font.getlength(char))
    mask = Image.new("L", (max(advance, font.font.getbbox(char)[2]) + 1, font.line_height))
    ImageDraw.Draw(mask).text((0, -font.top), char, fill=255, font=font.font)
    return mask, advance


@lru_cache(maxsize=2048)
def _line(font: _Font, text: str) -> Image.Image:
    """``text`` as a mask one line box high, from cached glyphs."""
    mask = Image.new("L", (max(1, _fast_width(font, text) + 2), font.line_height))
    x = 0
    for char in text:
        glyph, advance = _glyph(font, char)
        mask.paste(255, (x, 0), glyph)
        x += advance
    return mask


def _fast_width(font: _Font, text: str) -> int:
    return sum(_glyph(font, char)[1] for char in text)


def _fast_text(
    font: _Font, canvas: Image.Image, xy: tuple[int, int], text: str, colour=(0, 0, 0)
) -> None:
    """Draw ``text`` (black by default) from cached glyphs (no kerning): a page redrawn at
    every input change sets the same few characters over and over, and FreeType's rendering
    of each string costs milliseconds. Lines seen before are pasted whole."""
    canvas.paste(colour, xy, _line(font, text))


def _stack(pictures: Sequence[Image.Image], pad: int) -> Image.Image:
    """Pictures one under the other, left-aligned on white, ``pad`` px apart."""
    height = sum(p.height + pad for p in pictures) - pad
    canvas = Image.new("RGB", (max(p.width for p in pictures), height), "white")
    y = 0
    for p in pictures:
        canvas.paste(p, (0, y))
        y += p.height + pad
    return canvas


# ----------------------------------------------------------------------------- grids


def labelled_grid(
    tiles: torch.Tensor,
    *,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    title: str = "",
    zoom: int = 3,
    card_width: int = CARD_WIDTH,
) -> torch.Tensor:
    """Lay out (rows, cols, 3, H, W) tiles as one picture with readable labels.

    The labels are sized to the whole picture: once it is scaled down to ``card_width``
    px wide (as TensorBoard shows it in a card), capital letters are still
    :data:`CAP_HEIGHT` px high. Column labels wider than their tiles (less a gap) are set
    smaller, to fit (with zoom 3, labels like ``7>1`` keep the full size up to about 10
    columns); the title wraps onto more lines. Empty labels take no room.

    Returns:
        (3, height, width) uint8, ready for ``SummaryWriter.add_image``.
    """
    rows, cols = tiles.shape[:2]
    grid = make_grid(_pixels(tiles.flatten(0, 1), zoom), nrow=cols, padding=2, pad_value=255)
    body = to_pil_image(grid)
    tile_h, tile_w = (body.height - 2) // rows, (body.width - 2) // cols

    # The row labels widen the picture, which asks for a larger font: grow both until the
    # font is large enough for the width it makes.
    font = _label_font(body.width, card_width)
    while True:
        pad = max(2, font.cap_height // 3)
        row_width = max(map(font.width, row_labels), default=0)
        left = 2 * pad + row_width if row_width else 0
        width = body.width + left
        needed = _label_font(width, card_width)
        if needed.size <= font.size:
            break
        font = needed
    # A gap of an eighth of a tile between neighbouring labels, so that "6>1" "5>8" set
    # as wide as their tiles do not read as one "6>15>8".
    col_font = _fitting(font, col_labels, tile_w - 2 - tile_w // 8)
    title_font = _fitting(font, title.split(), width - 2 * pad)
    title_lines = _wrap(title_font, title, width - 2 * pad)
    title_h = len(title_lines) * title_font.line_height + pad if title_lines else 0
    col_h = col_font.line_height + pad if any(s.strip() for s in col_labels) else 0
    top = pad + title_h + col_h if title_h or col_h else 0

    canvas = Image.new("RGB", (width, body.height + top), "white")
    canvas.paste(body, (left, top))
    for i, line in enumerate(title_lines):
        title_font.draw(canvas, (pad, pad + i * title_font.line_height), line)
    for r, text in enumerate(row_labels):
        y = top + 2 + r * tile_h + (tile_h - 2) // 2 - font.cap_middle  # capitals centred
        font.draw(canvas, (pad, y), text)
    for c, text in enumerate(col_labels):
        x = left + 2 + c * tile_w + (tile_w - 2 - col_font.width(text)) // 2
        col_font.draw(canvas, (x, top - col_h), text)
    return pil_to_tensor(canvas)


def captioned_grid(
    tiles: torch.Tensor, captions: Sequence[str], *, cols: int = 10, title: str = "", zoom: int = 3
) -> torch.Tensor:
    """Lay out (N, 3, H, W) tiles in rows of ``cols``, each with a caption above it.

    Cells after the last tile stay white, so the picture holds exactly N tiles. The text
    keeps Pillow's small default font (about 11 px): with 20 columns, as in
    ``misclassified.png``, a caption cannot be readable at TensorBoard's card size anyway.

    Returns:
        (3, height, width) uint8.
    """
    n, _, h, w = tiles.shape
    cell_h, cell_w = h * zoom + 14, w * zoom + 4
    top = 16 if title else 0
    canvas = Image.new("RGB", (cols * cell_w, top + max(1, -(-n // cols)) * cell_h), "white")
    draw = ImageDraw.Draw(canvas)  # without a font: Pillow's default one
    draw.text((4, 2), title, fill="black")
    for i, tile in enumerate(_pixels(tiles, zoom)):
        x, y = i % cols * cell_w + 2, top + i // cols * cell_h
        draw.text((x, y + 1), captions[i], fill="black")
        canvas.paste(to_pil_image(tile), (x, y + 13))
    return pil_to_tensor(canvas)


def tile_table(
    rows: Sequence[torch.Tensor],
    *,
    row_labels: Sequence[str],
    captions: Sequence[Sequence[str]],
    zoom: int = 4,
    cap_height: int = 9,
) -> torch.Tensor:
    """Lay out rows of tiles with a label left of each row and a caption under each tile.

    Rows may hold different numbers of tiles (a pruned model's blocks have different head
    counts); the picture is as wide as the longest row. A caption may hold several lines
    (``"\n"``); each is set smaller where it is wider than its tile.

    Args:
        rows: one (n_r, 3, H, W) float tensor in [0, 1] per row, all tiles H x W.
        row_labels: one label per row.
        captions: ``captions[r][i]`` under tile i of row r.
        zoom: magnification of each tile.
        cap_height: height of a capital letter of the text, in px.

    Returns:
        (3, height, width) uint8.
    """
    h, w = rows[0].shape[-2] * zoom, rows[0].shape[-1] * zoom
    font = _font(cap_height)
    pad = max(2, font.cap_height // 2)
    lines = max((len(c.split("\n")) for row in captions for c in row), default=0)
    cell_w, cell_h = w + 2 * pad, h + lines * font.line_height + 2 * pad
    left = max((_fast_width(font, t) for t in row_labels), default=0) + 2 * pad
    canvas = Image.new("RGB", (left + max(map(len, rows)) * cell_w, len(rows) * cell_h), "white")
    for r, (tiles, label) in enumerate(zip(rows, row_labels, strict=True)):
        top = r * cell_h + pad
        _fast_text(font, canvas, (pad, top + h // 2 - font.cap_middle), label)
        for i, tile in enumerate(_pixels(tiles, zoom)):
            x = left + i * cell_w + pad
            canvas.paste(to_pil_image(tile), (x, top))
            for k, line in enumerate(captions[r][i].split("\n")):
                small = _fitting(font, [line], w, _fast_width)
                y = top + h + pad // 2 + k * font.line_height
                _fast_text(small, canvas, (x + (w - _fast_width(small, line)) // 2, y), line)
    return pil_to_tensor(canvas)


def heatmap_panels(
    panels: torch.Tensor,
    *,
    titles: Sequence[str],
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    colorbar_label: str,
    title: str,
    limit: float | None = None,
    columns: int = 4,
    x_label: str = "",
):
    """Small multiples of heat maps on one diverging colour scale centred on 0, shared by
    every panel (a pale panel is a small one), with a colour bar.

    Args:
        panels: (P, rows, cols) values; NaN cells (a head a pruned block lacks) are grey.
        limit: the colour scale's half-width; None: the 98th percentile of the absolute
            values (the colour bar's arrows stand for the cells beyond).
        columns: panels per row of the figure.
        x_label: under the bottom panels.

    Returns:
        A matplotlib figure (save it with :func:`vit_mnist.io.save_figure`).
    """
    # A Figure of its own, not pyplot's: no backend to choose, nothing global to close.
    from matplotlib.figure import Figure

    values = panels.float().cpu().numpy()
    finite = np.abs(values[np.isfinite(values)])
    # A few large cells (a class read by one MLP) would leave every other cell white: the
    # scale ends at the 98th percentile, and the colour bar's arrows say that some go past.
    limit = limit or float(np.quantile(finite, 0.98) if finite.size else 1.0) or 1.0
    p, r, c = values.shape
    columns = min(columns, p)
    lines = math.ceil(p / columns)
    figsize = ((0.9 + 0.32 * c) * columns + 1.2, (0.75 + 0.3 * r) * lines + 0.6)
    fig = Figure(figsize=figsize, dpi=110, layout="constrained")
    axes = fig.subplots(lines, columns, squeeze=False)
    cmap = colormaps["RdBu_r"].with_extremes(bad="#bbbbbb")
    for i, ax in enumerate(axes.flat):
        if i >= p:
            ax.axis("off")
            continue
        image = ax.imshow(values[i], cmap=cmap, vmin=-limit, vmax=limit, aspect="auto")
        ax.set_title(titles[i], fontsize=8)
        ax.set_xticks(range(c), col_labels, fontsize=6, rotation=90 if c > 8 else 0)
        ax.set_yticks(range(r), row_labels if i % columns == 0 else [], fontsize=6)
        if x_label and i >= p - columns:
            ax.set_xlabel(x_label, fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.colorbar(image, ax=axes, label=colorbar_label, shrink=0.8, extend="both")
    return fig


@lru_cache(maxsize=256)
def _colour_bar(
    width: int, low: str, high: str, caption: str, cmap: str, font: _Font
) -> Image.Image:
    """A horizontal colour bar ``width`` px wide under ``caption``: the colour map from left
    to right, ``low`` under its left end and ``high`` under its right end (cached: only read
    it)."""
    pad = max(2, font.cap_height // 2)
    lines = _wrap(font, caption, width, _fast_width)
    bar_top = len(lines) * font.line_height + pad
    bar_h = 2 * font.line_height // 3
    colours = _colormap(cmap)[torch.linspace(0, 255, width).round().long()]  # (width, 3)
    strip = (colours[None].expand(bar_h, -1, -1).numpy() * 255).round().astype(np.uint8)
    canvas = Image.new("RGB", (width, bar_top + bar_h + pad + font.line_height), "white")
    for i, line in enumerate(lines):
        _fast_text(font, canvas, (0, i * font.line_height), line)
    canvas.paste(Image.fromarray(strip), (0, bar_top))
    y = bar_top + bar_h + pad
    _fast_text(font, canvas, (0, y), low)
    _fast_text(font, canvas, (width - _fast_width(font, high), y), high)
    return canvas


def with_colour_bar(
    picture: torch.Tensor,
    *,
    low: str,
    high: str,
    caption: str,
    cmap: str = "inferno",
    width: int | None = None,
    cap_height: int = 9,
) -> torch.Tensor:
    """``picture`` (3, H, W) uint8 with a colour bar under it: the colour map from ``low``
    (its first colour) to ``high`` (its last), ``caption`` saying what the colours measure.

    Args:
        width: the bar's width in px; default the picture's (at most 320 px).
        cap_height: height of a capital letter of the text, in px.

    Returns:
        (3, H + bar, W') uint8, W' the larger of W and the bar's width.
    """
    font = _font(cap_height)
    bar = _colour_bar(width or min(picture.shape[-1], 320), low, high, caption, cmap, font)
    return pil_to_tensor(_stack([to_pil_image(picture), bar], pad=max(2, font.cap_height)))


def attention_matrix(
    weights: torch.Tensor,
    labels: Sequence[str],
    *,
    cell: int = 16,
    low: float | None = None,
    high: float | None = None,
    cmap: str = "inferno",
    cap_height: int = 8,
) -> torch.Tensor:
    """A (T, T) attention matrix as a picture with its tokens named: ``labels[i]`` left of
    row i (the query) and above column i (the key, set upright). Where the cells are
    smaller than a line of text, every k-th token is named, so that names do not overlap.

    Args:
        weights: (T, T) float.
        labels: T names, e.g. ``CLS``, ``0,0``, ``0,1``, ...
        cell: the side of one cell, in px.
        low, high: the values of the colour map's ends; None: the matrix's own range.

    Returns:
        (3, H, W) uint8; the cells are the square of side ``T * cell`` that ends ``over``
        px before the right and bottom edges (``over`` > 0 where names are taller than a
        cell).
    """
    font = _font(cap_height)
    pad = max(2, font.cap_height // 2)
    named = range(0, weights.shape[-1], max(1, math.ceil(font.line_height / cell)))
    colours = colorize(weights[None].float(), cmap, low=low, high=high)
    body = to_pil_image(_pixels(colours, cell)[0])
    # Names taller than a cell stick out past the first and last cells: room for them.
    over = max(0, (font.line_height - cell) // 2 + 1)
    left = max(_fast_width(font, labels[i]) for i in named) + 2 * pad + over
    top = left  # the column names are the row names, set upright
    canvas = Image.new("RGB", (left + body.width + over, top + body.height + over), "white")
    canvas.paste(body, (left, top))
    for i in named:
        name, middle = labels[i], i * cell + cell // 2 - font.line_height // 2
        _fast_text(font, canvas, (left - pad - _fast_width(font, name), top + middle), name)
        column = Image.new("RGB", (top, font.line_height), "white")
        _fast_text(font, column, (pad, 0), name)
        canvas.paste(column.rotate(90, expand=True), (left + middle, 0))
    return pil_to_tensor(canvas)


def stack_pictures(
    pictures: Sequence[torch.Tensor], titles: Sequence[str], cap_height: int = 11
) -> torch.Tensor:
    """(3, H_i, W_i) uint8 pictures one under the other, each under its title, on white.

    Returns:
        (3, H, W) uint8.
    """
    font = _font(cap_height)
    parts = []
    for picture, title in zip(pictures, titles, strict=True):
        heading = Image.new("RGB", (max(1, _fast_width(font, title)), font.line_height), "white")
        _fast_text(font, heading, (0, 0), title)
        parts += [heading, to_pil_image(picture)]
    return pil_to_tensor(_stack(parts, pad=max(2, font.cap_height)))


def value_table(
    values: torch.Tensor,
    *,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    limit: float,
    off: torch.Tensor | None = None,
    cell: tuple[int, int] = (46, 22),
    cap_height: int = 8,
) -> torch.Tensor:
    """A (R, C) table of signed values as coloured cells with the value written in each
    (``+0.85``): :func:`diverging` colours on the scale ``-limit`` .. ``+limit`` (red
    positive, blue negative); ``off`` cells (R, C) bool are grey and say ``off``; NaN cells
    (a head a pruned block lacks) are left white.

    Returns:
        (3, H, W) uint8.
    """
    font = _font(cap_height)
    pad = max(2, font.cap_height // 2)
    width, height = cell
    left = max(_fast_width(font, t) for t in row_labels) + 2 * pad
    top = font.line_height + pad
    rows, cols = values.shape
    canvas = Image.new("RGB", (left + cols * width, top + rows * height), "white")
    colours = _pixels(diverging(values[None], limit), 1)[0]
    for c, label in enumerate(col_labels):
        x = left + c * width + (width - _fast_width(font, label)) // 2
        _fast_text(font, canvas, (x, 0), label)
    for r, label in enumerate(row_labels):
        y = top + r * height
        text_y = y + (height - font.line_height) // 2
        _fast_text(font, canvas, (pad, text_y), label)
        for c in range(cols):
            value, x0 = float(values[r, c]), left + c * width
            if math.isnan(value):
                continue
            is_off = off is not None and bool(off[r, c])
            fill = (200, 200, 200) if is_off else tuple(colours[:, r, c].tolist())
            canvas.paste(fill, (x0 + 1, y + 1, x0 + width - 1, y + height - 1))
            text = "off" if is_off else f"{value:+.2f}"
            x = x0 + (width - _fast_width(font, text)) // 2
            dark = sum(fill) < 300  # white text on the deepest reds and blues
            _fast_text(font, canvas, (x, text_y), text, (255, 255, 255) if dark else (0, 0, 0))
    return pil_to_tensor(canvas)
