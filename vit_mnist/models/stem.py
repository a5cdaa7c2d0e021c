"""Images to tokens: the textbook patch embedding and the ViT paper's hybrid stem.

:class:`PatchEmbedding` is ViT eq. 1's x_p E (Dosovitskiy et al. 2021, "An Image is Worth
16x16 Words"). :class:`ConvStem` is that paper's hybrid model (section 3.1, "Hybrid
Architecture"): the patch embedding E applied to a CNN's feature map instead of the raw
pixels. Xiao et al. 2021 ("Early Convolutions Help Transformers See Better") build that
CNN for small models as a few 3x3 convolutions with BatchNorm and ReLU, stride 2, ending
in a 1x1 convolution to the width D; Hassani et al. 2021 (Compact Transformers) show it
helps most on small datasets. The token grid, the CLS token, the encoder and every
analysis stay those of the textbook model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from vit_mnist.models.checks import conv_stem_layout


def check_image_size(x: torch.Tensor, img_size: int) -> None:
    """Raise a ValueError naming both sizes when images (B, C, H, W) are not img_size^2."""
    if x.shape[-2:] != (img_size, img_size):
        raise ValueError(
            f"image of size {tuple(x.shape[-2:])} given to a model built for "
            f"img_size={img_size}; resize the images or rebuild the model"
        )


class PatchEmbedding(nn.Module):
    """Cut an image into non-overlapping patches and project each to ``embed_dim``.

    ViT eq. 1 as written: each patch flattened to ``in_chans * patch_size**2`` pixels and
    multiplied by E. E is held as a convolution's weight (D, C, p, p) (kernel = stride = p,
    the same linear map), the layout timm and every checkpoint of this project use.

    Shapes: (batch, in_chans, img_size, img_size) float -> (batch, num_patches, embed_dim),
    with ``num_patches = (img_size // patch_size) ** 2``.
    """

    def __init__(self, *, img_size: int, patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.img_size = img_size
        self.patch_size = patch_size
        self.grid_size = img_size // patch_size
        self.num_patches = self.grid_size**2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_image_size(x, self.img_size)
        p = self.patch_size
        patches = rearrange(x, "b c (gh p1) (gw p2) -> b (gh gw) (c p1 p2)", p1=p, p2=p)
        # A matrix product, not the convolution: oneDNN's backward of a one-channel
        # convolution is slow on AVX2 CPUs.
        return F.linear(patches, self.proj.weight.flatten(1), self.proj.bias)  # x_p E


class ConvStem(nn.Module):
    """3x3 convolutions (BatchNorm, ReLU) with the strides of
    :func:`~vit_mnist.models.checks.conv_stem_layout`,
    then a projection to ``embed_dim`` with kernel = stride = what is left of the patch
    (1x1 when the strides made the whole patch): the same ``(img_size // patch_size) ** 2``
    tokens as :class:`PatchEmbedding`, each seeing ``receptive_field`` pixels
    (overlapping neighbours) instead of its own patch. A stride-1 convolution before the
    last stride 2 works at a finer grid than the tokens', as the ViT paper's hybrid does
    with its ResNet stages.

    Args:
        img_size, patch_size, in_chans, embed_dim: as for the patch embedding.
        channels: output channels of each 3x3 convolution; None: the layout's default.
        strides: each convolution's stride; None: stride 2 while the patch allows.

    Shapes: (batch, in_chans, img_size, img_size) float -> (batch, num_patches, embed_dim).

    Raises:
        ConfigError: see :func:`~vit_mnist.models.checks.conv_stem_layout`.
    """

    def __init__(
        self,
        *,
        img_size: int,
        patch_size: int,
        in_chans: int,
        embed_dim: int,
        channels: Sequence[int] | None = None,
        strides: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.img_size = img_size
        self.patch_size = patch_size
        self.grid_size = img_size // patch_size
        self.num_patches = self.grid_size**2
        layers: list[nn.Module] = []
        left, width, field, jump = patch_size, in_chans, 1, 1  # field, jump: pixels
        channels, strides = conv_stem_layout(patch_size, channels, strides)
        for out, stride in zip(channels, strides, strict=True):
            layers += [
                nn.Conv2d(width, out, 3, stride=stride, padding=1, bias=False),
                nn.BatchNorm2d(out),
                nn.ReLU(inplace=True),
            ]
            field, jump, left, width = field + 2 * jump, jump * stride, left // stride, out
        self.convs = nn.Sequential(*layers)
        self.proj = nn.Conv2d(width, embed_dim, kernel_size=left, stride=left)
        self.receptive_field = field + (left - 1) * jump

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_image_size(x, self.img_size)
        return rearrange(self.proj(self.convs(x)), "b d gh gw -> b (gh gw) d")
