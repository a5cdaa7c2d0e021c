"""Augmentation of whole batches with tensor ops, on the batch's device."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vit_mnist.errors import ConfigError


class BatchRandomAffine(nn.Module):
    """A random rotation, scale and translation per image, for a whole batch at once.

    One ``affine_grid`` + ``grid_sample`` call for the batch instead of one PIL
    transform per image: cheap on a CPU and free on a GPU. Pixels that come from
    outside the image are filled with ``fill`` (the normalised value of a black pixel).

    Args:
        degrees: rotation angle drawn uniformly from [-degrees, degrees].
        translate: shift drawn uniformly from [-translate, translate] times the image
            side, independently along x and y (0.1 = up to 2.8 pixels on MNIST).
        scale: zoom factor drawn uniformly from [scale[0], scale[1]].
        fill: value of the pixels brought in from outside the image.

    Shapes: (batch, channels, H, W) float -> same shape and dtype.

    Raises:
        ConfigError: negative ``degrees`` or ``translate``, or a non-positive or
            reversed ``scale`` range.
    """

    def __init__(
        self,
        *,
        degrees: float = 0.0,
        translate: float = 0.0,
        scale: tuple[float, float] | list[float] = (1.0, 1.0),
        fill: float = 0.0,
    ) -> None:
        super().__init__()
        if degrees < 0 or translate < 0:
            raise ConfigError(
                f"augment.degrees={degrees} and augment.translate={translate} must be >= 0"
            )
        lo, hi = scale
        if not 0 < lo <= hi:
            raise ConfigError(f"augment.scale={list(scale)} must be [min, max] with 0 < min <= max")
        self.degrees, self.translate, self.scale, self.fill = degrees, translate, (lo, hi), fill

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]

        def uniform(lo: float, hi: float) -> torch.Tensor:
            return torch.empty(b, device=x.device).uniform_(lo, hi)

        angle = uniform(-self.degrees, self.degrees) * (math.pi / 180)
        inv_scale = 1.0 / uniform(*self.scale)
        # affine_grid maps output to input coordinates in [-1, 1], so a shift of a
        # fraction f of the image is 2f there, and zooming in by s divides by s.
        tx = uniform(-self.translate, self.translate) * 2
        ty = uniform(-self.translate, self.translate) * 2
        cos, sin = torch.cos(angle) * inv_scale, torch.sin(angle) * inv_scale
        theta = torch.stack(
            [torch.stack([cos, -sin, tx], dim=1), torch.stack([sin, cos, ty], dim=1)], dim=1
        ).to(x.dtype)  # (B, 2, 3)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        # grid_sample pads with zeros: shift the background to 0 and back.
        out = F.grid_sample(
            x - self.fill, grid, mode="bilinear", padding_mode="zeros", align_corners=False
        )
        return out + self.fill

    def extra_repr(self) -> str:
        return f"degrees={self.degrees}, translate={self.translate}, scale={self.scale}"
