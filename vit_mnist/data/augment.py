"""Augmentation of whole batches with tensor ops, on the batch's device."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from vit_mnist.errors import ConfigError


def _uniform(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """One draw per image of the batch ``x``, uniform in [lo, hi), on ``x``'s device."""
    return torch.empty(x.shape[0], device=x.device).uniform_(lo, hi)


@functools.lru_cache(maxsize=8)
def _base_grid(h: int, w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(3, h*w): each output pixel's (x, y, 1) in ``F.affine_grid``'s [-1, 1] coordinates
    (``align_corners=False``), taken from ``F.affine_grid`` itself with the identity map."""
    identity = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]], device=device, dtype=dtype)
    xy = F.affine_grid(identity, [1, 1, h, w], align_corners=False).reshape(h * w, 2)
    return torch.cat([xy, xy.new_ones(h * w, 1)], dim=1).T.contiguous()


def affine_grid(theta: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``F.affine_grid(theta, (B, C, h, w), align_corners=False)``, as one matrix product.

    The grid is linear in ``theta``: each pixel's source point is ``theta @ (x, y, 1)``.
    ``F.affine_grid`` builds a (B, h, w, 3) base grid per call and multiplies B small
    matrices: 1.16 ms for a batch of 256 28 x 28 images on a 2-core AMD EPYC (about 3% of
    a training step), where this (2B, 3) x (3, h*w) product takes 0.05 ms
    (docs/speed.md). The values agree to float rounding (tests/test_data.py).

    Shapes: theta (B, 2, 3) float -> grid (B, h, w, 2), a view of a (B, 2, h, w) tensor.
    """
    b = theta.shape[0]
    base = _base_grid(h, w, theta.device, theta.dtype)
    return (theta.reshape(b * 2, 3) @ base).view(b, 2, h, w).permute(0, 2, 3, 1)


@functools.lru_cache(maxsize=8)
def _gaussian_matrix(
    n: int, sigma: float, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """(n, n) matrix M such that ``M @ s`` blurs a signal ``s`` of length ``n`` with a
    Gaussian of ``sigma`` samples over +-4 sigma (cut to n - 1), borders reflected.
    Cached: every batch of a run asks for the same one or two."""
    r = min(math.ceil(4 * sigma), n - 1)
    t = torch.arange(-r, r + 1, device=device, dtype=dtype)
    g = torch.exp(-0.5 * (t / sigma) ** 2)
    eye = torch.eye(n, device=device, dtype=dtype).unsqueeze(1)
    # Row j of the blurred identity is the blur of the unit signal e_j: column j of M.
    blurred = F.conv1d(F.pad(eye, (r, r), mode="reflect"), (g / g.sum()).view(1, 1, -1))
    return blurred.squeeze(1).T


class BatchRandomAffine(nn.Module):
    """A random rotation, scale and translation per image, and optionally an elastic
    distortion, for a whole batch at once.

    One ``affine_grid`` + ``grid_sample`` call for the batch instead of one PIL
    transform per image: cheap on a CPU and free on a GPU. Pixels that come from
    outside the image are filled with ``fill`` (the normalised value of a black pixel).

    Args:
        degrees: rotation angle drawn uniformly from [-degrees, degrees].
        translate: shift drawn uniformly from [-translate, translate] times the image
            side, independently along x and y (0.1 = up to 2.8 pixels on MNIST).
        scale: zoom factor drawn uniformly from [scale[0], scale[1]].
        hflip: mirror each image left-right with probability 1/2 (for Fashion-MNIST;
            never for digits).
        fill: value of the pixels brought in from outside the image.
        elastic_alpha: strength of the elastic distortion in pixels (0 = off): each pixel
            reads from ``alpha`` times a random field, uniform in [-1, 1] per pixel and
            direction, smoothed by a Gaussian of ``elastic_sigma`` pixels; Simard et al.
            2003, "Best Practices for Convolutional Neural Networks Applied to Visual
            Document Analysis", section 2, used alpha 34 and sigma 4 on MNIST (displacements
            of about 1.7 pixels, standard deviation). Drawn per image, added to the
            affine map, so the batch is still resampled once.
        elastic_sigma: the smoothing's standard deviation in pixels.

    Shapes: (batch, channels, H, W) float -> same shape and dtype.

    Each value's range is the settings schema's (``AugmentSettings``).

    Raises:
        ConfigError: a reversed ``scale`` range.
    """

    def __init__(
        self,
        *,
        degrees: float = 0.0,
        translate: float = 0.0,
        scale: tuple[float, float] | list[float] = (1.0, 1.0),
        hflip: bool = False,
        fill: float = 0.0,
        elastic_alpha: float = 0.0,
        elastic_sigma: float = 4.0,
    ) -> None:
        super().__init__()
        lo, hi = scale
        if lo > hi:
            raise ConfigError(f"data.augment.scale={list(scale)} must be [min, max], min <= max")
        self.hflip = bool(hflip)
        self.degrees, self.translate, self.scale, self.fill = degrees, translate, (lo, hi), fill
        self.elastic_alpha, self.elastic_sigma = elastic_alpha, elastic_sigma

    def _elastic(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, W, 2) displacements in ``affine_grid``'s [-1, 1] coordinates."""
        b, _, h, w = x.shape
        noise = torch.empty(b, 2, h, w, device=x.device, dtype=x.dtype).uniform_(-1, 1)
        # The Gaussian blur is separable: two small matrix products, tens of times faster
        # on a CPU than torchvision's gaussian_blur, which convolves with the square kernel.
        blur_h = _gaussian_matrix(h, self.elastic_sigma, x.device, x.dtype)
        blur_w = _gaussian_matrix(w, self.elastic_sigma, x.device, x.dtype)
        field = blur_h @ noise @ blur_w.T
        # A shift of d pixels is 2 d / size in [-1, 1] coordinates.
        scale = torch.tensor([2 / w, 2 / h], device=x.device, dtype=x.dtype)
        return field.permute(0, 2, 3, 1) * self.elastic_alpha * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angle = _uniform(x, -self.degrees, self.degrees) * (math.pi / 180)
        inv_scale = 1.0 / _uniform(x, *self.scale)
        # affine_grid maps output to input coordinates in [-1, 1], so a shift of a
        # fraction f of the image is 2f there, and zooming in by s divides by s.
        tx = _uniform(x, -self.translate, self.translate) * 2
        ty = _uniform(x, -self.translate, self.translate) * 2
        cos, sin = torch.cos(angle) * inv_scale, torch.sin(angle) * inv_scale
        # A mirror image reads input x from -x: negate the x column of the map.
        flip = torch.where(_uniform(x, 0, 1) < 0.5, -1.0, 1.0) if self.hflip else 1.0
        theta = torch.stack([cos * flip, -sin, tx, sin * flip, cos, ty], dim=1).view(-1, 2, 3)
        grid = affine_grid(theta.to(x.dtype), *x.shape[-2:])
        if self.elastic_alpha:
            grid = grid + self._elastic(x)
        # grid_sample (bilinear) pads with zeros: shift the background to 0 and back.
        return F.grid_sample(x - self.fill, grid, align_corners=False) + self.fill

    def extra_repr(self) -> str:
        return (
            f"degrees={self.degrees}, translate={self.translate}, scale={self.scale}, "
            f"hflip={self.hflip}, elastic_alpha={self.elastic_alpha}, "
            f"elastic_sigma={self.elastic_sigma}"
        )


class BatchRandomErasing(nn.Module):
    """Random erasing (Zhong et al. 2020, "Random Erasing Data Augmentation", Alg. 1),
    one rectangle per image, drawn independently for each image of the batch.

    With probability ``p`` an image gets a rectangle of area ``s * H * W`` (``s`` uniform in
    ``area``) and aspect ratio ``r`` (log-uniform in ``ratio``), placed uniformly so that it
    fits, filled with ``fill``. torchvision's ``RandomErasing`` erases the same rectangle
    in every image of a batch; this draws one per image with tensor ops.

    Shapes: (batch, channels, H, W) float -> same shape and dtype.

    ``p``'s range is the settings schema's (``AugmentSettings.erasing``).

    Raises:
        ConfigError: an empty ``area`` range.
    """

    def __init__(
        self,
        p: float,
        *,
        area: tuple[float, float] = (0.02, 0.2),
        ratio: tuple[float, float] = (0.3, 3.3),
        fill: float = 0.0,
    ) -> None:
        super().__init__()
        if not 0 < area[0] <= area[1] < 1:
            raise ConfigError(f"random erasing area={list(area)} must satisfy 0 < min <= max < 1")
        self.p, self.area, self.ratio, self.fill = p, area, ratio, fill

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0:
            return x
        b, _, h, w = x.shape
        area = _uniform(x, *self.area) * h * w
        ratio = torch.exp(_uniform(x, math.log(self.ratio[0]), math.log(self.ratio[1])))
        eh = torch.sqrt(area * ratio).round().clamp(1, h)
        ew = torch.sqrt(area / ratio).round().clamp(1, w)
        top = (_uniform(x, 0, 1) * (h - eh + 1)).floor()
        left = (_uniform(x, 0, 1) * (w - ew + 1)).floor()
        top, left, eh, ew = (t.view(b, 1, 1) for t in (top, left, eh, ew))
        rows = torch.arange(h, device=x.device).view(1, h, 1)
        cols = torch.arange(w, device=x.device).view(1, 1, w)
        # (B, H, W): the pixels inside each image's rectangle.
        inside = (top <= rows) & (rows < top + eh) & (left <= cols) & (cols < left + ew)
        erase = inside & (_uniform(x, 0, 1) < self.p).view(b, 1, 1)
        return x.masked_fill(erase.unsqueeze(1), self.fill)

    def extra_repr(self) -> str:
        return f"p={self.p}, area={self.area}, ratio={self.ratio}"


class BatchAugment(nn.Sequential):
    """The training augmentation of ``data.augment``: random affine (and mirror), then
    random erasing when ``erasing > 0``.

    Args:
        erasing: probability of :class:`BatchRandomErasing` per image (0 = off).
        fill: the normalised value of a black pixel.
        **affine: ``degrees``, ``translate``, ``scale``, ``hflip``, ``elastic_alpha``,
            ``elastic_sigma`` of :class:`BatchRandomAffine`.

    Raises:
        ConfigError: from :class:`BatchRandomAffine`.
    """

    def __init__(self, *, erasing: float = 0.0, fill: float = 0.0, **affine) -> None:
        erase = [BatchRandomErasing(erasing, fill=fill)] if erasing else []
        super().__init__(BatchRandomAffine(**affine, fill=fill), *erase)
