"""Argument checks of the Vision Transformer, run before anything is built.

``train(cfg)`` calls them before any data is loaded, so a bad shape fails in one line. Each
value's type and range is the schema's (``ModelSettings`` in vit_mnist/settings.py); what
is checked here are the combinations that the model's arithmetic needs.
"""

from __future__ import annotations

from collections.abc import Sequence

from vit_mnist.errors import ConfigError
from vit_mnist.models.attention import check_attention_args
from vit_mnist.settings import ModelSettings, check_arguments


def check_vit_args(
    *,
    img_size: int = 28,
    patch_size: int = 4,
    in_chans: int = 1,
    num_classes: int = 10,
    embed_dim: int = 64,
    depth: int = 6,
    num_heads: int | Sequence[int] = 4,
    head_dim: int | None = None,
    mlp_ratio: float = 2.0,
    dropout: float = 0.0,
    attn_dropout: float = 0.0,
    attention_impl: str = "explicit",
    causal: bool = False,
    qkv_bias: bool = True,
    drop_path_rate: float = 0.0,
    distillation: bool = False,
) -> None:
    """Check :class:`VisionTransformer` arguments without building anything.

    Called by the constructor and, before any data is loaded, by ``train(cfg)``.

    Raises:
        ConfigError (a ValueError): a value the schema refuses (``dropout=1.5 must be in
            [0, 1)``), or an impossible combination, naming the values:
            ``patch_size=5 does not divide img_size=28``, ``embed_dim=64 is not divisible
            by num_heads=3``, a ``num_heads`` list whose length is not ``depth`` or that
            comes without ``head_dim``, an MLP of width 0.
    """
    arguments = {k: v for k, v in locals().items()}
    check_arguments(ModelSettings, arguments)
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
        check_attention_args(
            embed_dim=embed_dim, num_heads=h, impl=attention_impl, head_dim=head_dim
        )
    if round(embed_dim * mlp_ratio) <= 0:
        raise ConfigError(f"mlp_ratio={mlp_ratio} gives an MLP of width 0 at embed_dim={embed_dim}")
