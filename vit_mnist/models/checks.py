"""Argument checks of the Vision Transformer, run before anything is built.

``train(cfg)`` calls them before any data is loaded, so a bad shape fails in one line. Each
value's type and range is the schema's (``ModelSettings`` in vit_mnist/settings.py); what
is checked here are the combinations that the model's arithmetic needs.
"""

from __future__ import annotations

from collections.abc import Sequence

from vit_mnist.errors import ConfigError
from vit_mnist.models.attention import check_attention_args


def check_vit_args(
    *,
    img_size: int,
    patch_size: int,
    embed_dim: int,
    depth: int,
    num_heads: int | Sequence[int],
    head_dim: int | None,
    mlp_ratio: float,
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
            comes without ``head_dim``, an MLP of width 0.
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
    if round(embed_dim * mlp_ratio) <= 0:
        raise ConfigError(f"mlp_ratio={mlp_ratio} gives an MLP of width 0 at embed_dim={embed_dim}")
