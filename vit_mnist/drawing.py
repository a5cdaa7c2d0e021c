"""Pictures as uint8 tensors for TensorBoard and PNG files: colour maps, overlays, grids."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange
from matplotlib import colormaps
from PIL import Image, ImageDraw, ImageFont
from torchvision.utils import make_grid


@lru_cache(maxsize=4)
def _colormap(name: str) -> torch.Tensor:
    return torch.from_numpy(colormaps[name](np.linspace(0, 1, 256))[:, :3]).float()


def _unit(x: torch.Tensor) -> torch.Tensor:
    """Min-max scale each leading item of (N, ...) to [0, 1]."""
    flat = x.flatten(1)
    lo, hi = flat.min(dim=1).values, flat.max(dim=1).values
    scale = (hi - lo).clamp_min(1e-12)
    return ((flat - lo[:, None]) / scale[:, None]).view_as(x)


def colorize(values: torch.Tensor, cmap: str = "inferno") -> torch.Tensor:
    """Map (N, H, W) values to (N, 3, H, W) RGB in [0, 1], each item scaled to its own range."""
    idx = (_unit(values.float()) * 255).round().long()
    return rearrange(_colormap(cmap)[idx.cpu()], "n h w c -> n c h w")


def overlay(
    images: torch.Tensor, maps: torch.Tensor, alpha: float = 0.6, cmap: str = "inferno"
) -> torch.Tensor:
    """Overlay attention maps in colour on grey images.

    Args:
        images: (N, 1, H, W) float, any normalisation (each is min-max scaled).
        maps: (N, g, g) attention over the patch grid; upsampled bilinearly to H x W.
        alpha: weight of the colour.

    Returns:
        (N, 3, H, W) float in [0, 1].
    """
    h, w = images.shape[-2:]
    up = F.interpolate(maps[:, None].float(), size=(h, w), mode="bilinear", align_corners=False)
    return (1 - alpha) * grey(images) + alpha * colorize(up[:, 0].cpu(), cmap)


@lru_cache(maxsize=1)
def _font() -> ImageFont.ImageFont:
    return ImageFont.load_default()


def labelled_grid(
    tiles: torch.Tensor,
    *,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    title: str = "",
    zoom: int = 3,
) -> torch.Tensor:
    """Lay out (rows, cols, 3, H, W) tiles as one picture with readable labels.

    Returns:
        (3, height, width) uint8, ready for ``SummaryWriter.add_image``.
    """
    rows, cols = tiles.shape[:2]
    tiles = F.interpolate(tiles.flatten(0, 1), scale_factor=zoom, mode="nearest")
    grid = make_grid(tiles, nrow=cols, padding=2, pad_value=1.0)  # (3, H, W)
    body = Image.fromarray((grid.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
    left, top = 8 + 6 * max((len(s) for s in row_labels), default=0), 14 + (14 if title else 0)
    canvas = Image.new("RGB", (body.width + left, body.height + top), "white")
    canvas.paste(body, (left, top))
    draw = ImageDraw.Draw(canvas)
    if title:
        draw.text((4, 2), title, fill="black", font=_font())
    tile_h, tile_w = (body.height - 2) // rows, (body.width - 2) // cols
    for r, text in enumerate(row_labels):
        draw.text((4, top + 2 + r * tile_h + tile_h // 2 - 5), text, fill="black", font=_font())
    for c, text in enumerate(col_labels):
        draw.text((left + 4 + c * tile_w, top - 12), text, fill="black", font=_font())
    return torch.from_numpy(np.asarray(canvas).copy()).permute(2, 0, 1)


def captioned_grid(
    tiles: torch.Tensor, captions: Sequence[str], *, cols: int = 10, title: str = "", zoom: int = 3
) -> torch.Tensor:
    """Lay out (N, 3, H, W) tiles in rows of ``cols``, each with a caption above it.

    Cells after the last tile stay white, so the picture holds exactly N tiles.

    Returns:
        (3, height, width) uint8.
    """
    n, _, h, w = tiles.shape
    cell_h, cell_w = h * zoom + 14, w * zoom + 4
    rows = max(1, -(-n // cols))
    top = 16 if title else 0
    canvas = Image.new("RGB", (cols * cell_w, top + rows * cell_h), "white")
    draw = ImageDraw.Draw(canvas)
    if title:
        draw.text((4, 2), title, fill="black", font=_font())
    big = F.interpolate(tiles.float(), scale_factor=zoom, mode="nearest")
    pixels = (big.clamp(0, 1).permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    for i in range(n):
        r, c = divmod(i, cols)
        x, y = c * cell_w + 2, top + r * cell_h
        draw.text((x, y + 1), captions[i], fill="black", font=_font())
        canvas.paste(Image.fromarray(pixels[i]), (x, y + 13))
    return torch.from_numpy(np.asarray(canvas).copy()).permute(2, 0, 1)


def grey(images: torch.Tensor) -> torch.Tensor:
    """(N, 1, H, W) images of any normalisation -> (N, 3, H, W) grey in [0, 1]."""
    return _unit(images.float().cpu()).expand(-1, 3, -1, -1)
