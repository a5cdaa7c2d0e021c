"""A small convolutional network: the teacher of DeiT's hard distillation.

Touvron et al. 2021 (DeiT, section 5.2) find a convnet the better teacher for a ViT: its
labels hand the student the convolution's inductive bias (locality, translation
equivariance). This one is the VGG pattern (Simonyan and Zisserman 2015) at MNIST's scale:
two stages of two 3 x 3 convolutions with batch normalisation (Ioffe and Szegedy 2015) and
ReLU, each closed by a 2 x 2 max-pool, then a hidden layer and the classifier.
"""

from __future__ import annotations

import torch
from torch import nn

from vit_mnist.errors import ConfigError

WIDTHS = (32, 64)  # channels of the two stages
HIDDEN = 128  # features of the hidden layer


def check_cnn_args(*, img_size: int, in_chans: int, num_classes: int) -> None:
    """Check :class:`ConvNet` arguments without building anything.

    Raises:
        ConfigError: an ``img_size`` the two 2 x 2 pools do not divide (each value's own
            range is the settings schema's).
    """
    if img_size % 4:
        raise ConfigError(f"model.img_size={img_size} must be a multiple of 4 for model=cnn")


class ConvNet(nn.Module):
    """The convnet teacher (``model=cnn``, ``experiment=cnn_teacher``): 0.47M parameters at
    28 x 28.

    Args:
        img_size: image height = width, in pixels; a multiple of 4.
        in_chans: image channels.
        num_classes: number of output logits.

    Shapes: images (batch, in_chans, img_size, img_size) float -> logits (batch, num_classes).

    Raises:
        ConfigError: see :func:`check_cnn_args`.
    """

    def __init__(self, *, img_size: int = 28, in_chans: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        check_cnn_args(img_size=img_size, in_chans=in_chans, num_classes=num_classes)
        self.img_size, self.in_chans = img_size, in_chans
        layers: list[nn.Module] = []
        channels = in_chans
        for width in WIDTHS:
            for _ in range(2):
                layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False)]
                layers += [nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
                channels = width
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        side = img_size // 4
        self.hidden = nn.Sequential(
            nn.Flatten(), nn.Linear(channels * side * side, HIDDEN), nn.ReLU(inplace=True)
        )
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(HIDDEN, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> logits (B, num_classes)."""
        if x.shape[-2:] != (self.img_size, self.img_size):
            raise ValueError(
                f"image of size {tuple(x.shape[-2:])} given to a model built for "
                f"img_size={self.img_size}; resize the images or rebuild the model"
            )
        return self.head(self.drop(self.hidden(self.features(x))))
