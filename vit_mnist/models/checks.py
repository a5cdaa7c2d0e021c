"""Argument checks of the Vision Transformer, run before anything is built.

``train(cfg)`` calls them before any data is loaded, so a bad shape fails in one line. Each
value's type and range is the schema's (``ModelSettings`` in vit_mnist/settings.py); what
is checked here are the combinations that the model's arithmetic needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from vit_mnist.errors import ConfigError
from vit_mnist.models.attention import check_attention_args

# The 3x3 convolutions' channels when ``model.stem_channels`` is null: 7 x 7 tokens at
# patch_size 4, each seeing 7 x 7 pixels.
CONV_STEM_CHANNELS = (32, 64)
# The model settings that only the convolutional stem reads.
CONV_STEM_KEYS = ("stem_channels", "stem_strides")


def conv_stem_layout(
    patch_size: int, channels: Sequence[int] | None = None, strides: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """The output channels and the stride of each 3x3 convolution of a
    :class:`~vit_mnist.models.stem.ConvStem`, as it is built.

    Args:
        patch_size: the token's patch side, in pixels.
        channels: the convolutions' output channels; None: :data:`CONV_STEM_CHANNELS`.
        strides: one per convolution, in pixels (each >= 1: the settings schema), their
            product dividing ``patch_size`` (the projection steps by what is left); None:
            2 while what is left of the patch is even, then 1 (``[2, 2, 1]`` for three
            convolutions at patch 4).

    Returns:
        ``(channels, strides)``, two lists of one entry per convolution.

    Raises:
        ConfigError (a ValueError): no convolution (``channels=[]``: that would be the
            patch stem recorded as ``conv``), strides of another length than ``channels``,
            or whose product does not divide the patch.
    """
    channels = list(CONV_STEM_CHANNELS if channels is None else channels)
    if not channels:
        raise ConfigError(
            "model.stem_channels=[] gives the convolutional stem no convolution, which "
            "is the patch stem: use model.stem=patch, or give channels, e.g. "
            "model.stem_channels=[32,64]"
        )
    if strides is None:
        out, left = [], patch_size
        for _ in channels:
            out.append(2 if left % 2 == 0 else 1)
            left //= out[-1]
        return channels, out
    strides = list(strides)
    if len(strides) != len(channels):
        raise ConfigError(
            f"model.stem_strides={strides} needs one stride per convolution of "
            f"model.stem_channels={channels}: give {len(channels)} of them"
        )
    if patch_size % math.prod(strides):
        raise ConfigError(
            f"model.stem_strides={strides} step by {math.prod(strides)} pixels in all, which "
            f"does not divide patch_size={patch_size}: the tokens must stay the patch grid, "
            f"so make the strides' product a divisor of {patch_size}"
        )
    return channels, strides


def check_vit_args(
    *,
    img_size: int,
    patch_size: int,
    embed_dim: int,
    depth: int,
    num_heads: int | Sequence[int],
    head_dim: int | None,
    mlp_ratio: float,
    stem: str = "patch",
    stem_channels: Sequence[int] | None = None,
    stem_strides: Sequence[int] | None = None,
    **_: object,
) -> None:
    """Check the combinations of :class:`VisionTransformer` arguments that its arithmetic
    needs, without building anything; the other arguments are taken and ignored, so that
    a new one touches the constructor and the schema only.

    Called by the constructor and, before any data is loaded, by ``train(cfg)``
    (:func:`~vit_mnist.models.check_model_args`, which fills in the defaults and checks
    each value's own range against the settings schema first).

    Raises:
        ConfigError (a ValueError): an impossible combination, naming the values:
            ``patch_size=5 does not divide img_size=28``, ``embed_dim=64 is not divisible
            by num_heads=3``, a ``num_heads`` list whose length is not ``depth`` or that
            comes without ``head_dim``, an MLP of width 0, a conv stem's strides that
            :func:`conv_stem_layout` refuses.
    """
    if img_size % patch_size != 0:
        divisors = [d for d in range(1, img_size + 1) if img_size % d == 0]
        raise ConfigError(
            f"patch_size={patch_size} does not divide img_size={img_size}: "
            f"use a patch_size from {divisors}"
        )
    if isinstance(num_heads, Sequence) and not isinstance(num_heads, str):
        # One count per block, as a pruned model stores them (Michel et al. 2019, section 4).
        if len(num_heads) != depth:
            raise ConfigError(
                f"num_heads={list(num_heads)} needs one count per block (depth={depth})"
            )
        if head_dim is None:
            raise ConfigError(f"num_heads={list(num_heads)} (one count per block) needs head_dim")
    else:
        num_heads = [num_heads]
    for h in num_heads:
        check_attention_args(embed_dim=embed_dim, num_heads=h, head_dim=head_dim)
    if stem == "conv":
        conv_stem_layout(patch_size, stem_channels, stem_strides)
    if round(embed_dim * mlp_ratio) <= 0:
        raise ConfigError(f"mlp_ratio={mlp_ratio} gives an MLP of width 0 at embed_dim={embed_dim}")
