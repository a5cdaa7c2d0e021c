"""The labelled pictures: labels readable once TensorBoard scales the picture to its card."""

from __future__ import annotations

import pytest
import torch

from vit_mnist.analysis import drawing
from vit_mnist.analysis.drawing import CAP_HEIGHT, CARD_WIDTH, captioned_grid, labelled_grid

RED = torch.tensor([1.0, 0.0, 0.0])[:, None, None]


def red_tiles(*shape: int) -> torch.Tensor:
    return RED.expand(*shape, 3, 28, 28).clone()


def ink(picture: torch.Tensor) -> torch.Tensor:
    """(H, W) bool: the dark pixels of the text (tiles here are red, the rest white)."""
    return (picture < 100).all(dim=0)


def red(picture: torch.Tensor) -> torch.Tensor:
    return (picture[0] > 200) & (picture[1] < 50) & (picture[2] < 50)


def extent(mask: torch.Tensor, dim: int) -> tuple[int, int]:
    """First and last index along ``dim`` of (H, W) where ``mask`` has a True."""
    idx = torch.nonzero(mask.any(dim=1 - dim)).flatten()
    return int(idx[0]), int(idx[-1])


def runs(mask_1d: torch.Tensor) -> list[tuple[int, int]]:
    """Runs of True in a 1-d bool tensor, as (first, last) pairs."""
    edges = torch.diff(torch.cat([torch.zeros(1), mask_1d.float(), torch.zeros(1)]))
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return [(a, b - 1) for a, b in zip(starts, ends, strict=True)]


@pytest.mark.parametrize("cols", [1, 8, 16])
def test_labels_readable_at_card_width_and_off_the_tiles(cols):
    rows, zoom = 4, 3
    picture = labelled_grid(
        red_tiles(rows, cols),
        row_labels=[f"head {h}" for h in range(rows)],
        col_labels=[f"{c % 10}>{(c + 3) % 10}" for c in range(cols)],
        title="layer 0: CLS attention per head (true>predicted)",
        zoom=zoom,
    )
    assert picture.dtype == torch.uint8 and picture.dim() == 3 and picture.shape[0] == 3
    width = picture.shape[2]
    # Every tile pixel is there, and no text was drawn over the tiles or between them.
    is_red = red(picture)
    assert int(is_red.sum()) == rows * cols * (28 * zoom) ** 2
    (y0, y1), (x0, x1) = extent(is_red, 0), extent(is_red, 1)
    assert not ink(picture)[y0 : y1 + 1, x0 : x1 + 1].any()

    # Row labels, left of the tiles: each "head N" is as tall as a capital letter at least
    # (h and d rise above it), CAP_HEIGHT px once the picture is CARD_WIDTH px wide.
    row_ink = ink(picture)[:, :x0]
    tile_rows = runs(is_red.any(dim=1))
    assert len(tile_rows) == rows
    for top, bottom in tile_rows:
        first, last = extent(row_ink[top : bottom + 1], 0)  # the label beside this row
        assert (last - first + 1) * CARD_WIDTH / width >= CAP_HEIGHT

    # Column labels, between the title and the tiles, each inside its own tile's columns;
    # as tall as capitals up to 8 columns (with 16, "0>3" is wider than a tile at that size).
    tile_cols = runs(is_red.any(dim=0))
    assert len(tile_cols) == cols
    band = ink(picture)[:y0]
    first, last = runs(band[:, x0:].any(dim=1))[-1]  # the lowest line of text above the tiles
    if cols <= 8:
        assert (last - first + 1) * CARD_WIDTH / width >= CAP_HEIGHT
    for left, right in runs(band[first : last + 1].any(dim=0)):
        assert any(a <= left and right <= b for a, b in tile_cols), (left, right)


def test_long_column_labels_shrink_to_their_tiles():
    names = ["Ankle boot>T-shirt/top", "Pullover>Sneaker", "Bag>Dress"]
    picture = labelled_grid(red_tiles(2, 3), row_labels=["a", "b"], col_labels=names)
    is_red = red(picture)
    y0 = extent(is_red, 0)[0]
    tile_cols = runs(is_red.any(dim=0))
    words = runs(ink(picture)[:y0].any(dim=0))
    # Each label's ink (gaps between its words included) stays above its own tile.
    for c, (a, b) in enumerate(tile_cols):
        inside = [(lo, hi) for lo, hi in words if a <= lo and hi <= b]
        assert inside, names[c]
    assert all(any(a <= lo and hi <= b for a, b in tile_cols) for lo, hi in words)


def test_empty_labels_add_no_margin():
    tiles = red_tiles(1, 3)
    picture = labelled_grid(tiles, row_labels=[""], col_labels=["", "", ""])
    zoom = 3
    assert picture.shape == (3, 28 * zoom + 4, 3 * (28 * zoom + 2) + 2)
    assert not ink(picture).any()


def test_captioned_grid_holds_exactly_n_tiles_under_their_captions():
    n, cols, zoom = 23, 10, 3
    captions = [f"{i % 10}>{(i + 1) % 10} 87%" for i in range(n)]
    picture = captioned_grid(red_tiles(n), captions, cols=cols, title="23 misclassified")
    assert picture.dtype == torch.uint8
    assert picture.shape == (3, 16 + 3 * (28 * zoom + 14), cols * (28 * zoom + 4))
    is_red = red(picture)
    assert int(is_red.sum()) == n * (28 * zoom) ** 2
    tile_rows = runs(is_red.any(dim=1))
    assert len(tile_rows) == 3  # the last row holds 3 tiles, then white cells
    assert len(runs(is_red[tile_rows[-1][0]])) == n - 2 * cols
    for top, bottom in tile_rows:
        assert not ink(picture)[top : bottom + 1].any()
        assert ink(picture)[top - 12 : top].any()  # the captions


def test_attention_matrix_names_every_token_beside_its_row_and_above_its_column():
    labels = ["CLS"] + [f"{r},{c}" for r in range(4) for c in range(4)]
    weights = torch.rand(17, 17, generator=torch.Generator().manual_seed(0))
    picture = drawing.attention_matrix(weights, labels, cell=20)
    height, width = picture.shape[1:]
    left, top = width - 17 * 20, height - 17 * 20
    cells = (drawing.colorize(weights[None])[0] * 255).round().to(torch.uint8)
    assert torch.equal(
        picture[:, top:, left:], cells.repeat_interleave(20, 1).repeat_interleave(20, 2)
    )
    dark = ink(picture)
    for i in range(17):
        assert dark[top + i * 20 : top + (i + 1) * 20, :left].any(), f"row {i} has no name"
        assert dark[:top, left + i * 20 : left + (i + 1) * 20].any(), f"column {i} has no name"
    # Cells narrower than a line of text: every other token is named, none overlap.
    small = drawing.attention_matrix(weights, labels, cell=6)
    colour = (small.max(dim=0).values - small.min(dim=0).values) > 0  # cells, not text
    top, left = int(colour.any(dim=1).nonzero()[0]), int(colour.any(dim=0).nonzero()[0])
    assert len(runs(ink(small)[top:, :left].any(dim=1))) == 9  # lines of text beside rows


def test_a_colour_bar_says_what_its_ends_are():
    picture = torch.full((3, 50, 200), 128, dtype=torch.uint8)
    out = drawing.with_colour_bar(picture, low="0", high="0.87", caption="attention weight")
    assert torch.equal(out[:, :50, :200], picture)
    below = out[:, 50:]
    first, last = drawing.colorize(torch.tensor([[[0.0, 1.0]]]))[0, :, 0].T.mul(255).round()
    rows = [r for r in range(below.shape[1]) if (below[:, r, 0] == first).all()]
    assert rows and (below[:, rows[0], 199] == last).all()
    assert ink(below[:, : rows[0]]).any() and ink(below[:, rows[-1] + 1 :]).any()  # the words


def test_a_map_is_drawn_as_one_flat_block_per_token_with_the_grid_visible():
    """Issue 102: a 4 x 4 token map was upsampled bilinearly to 28 x 28, which suggests a
    finer resolution than the tokens have. Now each token is one colour over its 7 x 7
    pixels, and the first pixel row and column of each token (but the image's edge) is
    the grid line, the same colour darkened."""
    from vit_mnist.analysis.drawing import overlay

    maps = torch.arange(16.0).reshape(1, 4, 4)  # every token its own value
    picture = overlay(torch.rand(1, 1, 28, 28) * 0 + 0.5, maps)[0]  # (3, 28, 28)
    blocks = picture.unfold(1, 7, 7).unfold(2, 7, 7)  # (3, 4, 4, 7, 7): token rows, cols
    inside = blocks[..., 1:, 1:]
    assert torch.equal(inside, inside[..., :1, :1].expand_as(inside))  # flat
    colours = inside[..., 0, 0].flatten(1).T  # (16, 3)
    assert len({tuple(c.tolist()) for c in colours}) == 16
    # The lines between tokens, and none along the image's own edge.
    torch.testing.assert_close(picture[:, 7, 8], 0.75 * picture[:, 8, 8])
    torch.testing.assert_close(picture[:, 8, 14], 0.75 * picture[:, 8, 15])
    torch.testing.assert_close(picture[:, 0, 1], picture[:, 1, 1])
    torch.testing.assert_close(picture[:, 1, 0], picture[:, 1, 1])
