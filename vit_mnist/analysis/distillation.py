"""The distillation token beside the CLS token in a distilled model (DeiT, section 4)."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from vit_mnist.analysis.modes import evaluating
from vit_mnist.models.vit import VisionTransformer


@torch.no_grad()
def cls_dist_similarity(
    model: VisionTransformer, images: torch.Tensor, batch_size: int = 500
) -> list[float]:
    """Cosine similarity of the CLS and distillation tokens, at the input and after each block.

    Touvron et al. 2021 (DeiT, section 4) report 0.06 between the two learned tokens at the
    input and 0.93 at the last layer: the tokens converge, yet stay apart.

    Args:
        model: a :class:`VisionTransformer` built with ``distillation=True``.
        images: (N, in_chans, H, W) float, as the model takes them.
        batch_size: images per forward pass.

    Returns:
        ``depth + 1`` floats in [-1, 1]: the embedded tokens (with their position
        embeddings), then each block's output, averaged over the images.

    Raises:
        ValueError: a model without a distillation token.
    """
    if model.dist_token is None:
        raise ValueError("the model has no distillation token (model.distillation=false)")
    sums = torch.zeros(model.depth + 1, dtype=torch.float64)
    with evaluating(model):
        for start in range(0, len(images), batch_size):
            embedded = model.embed(images[start : start + batch_size])
            rows = itertools.accumulate(model.blocks, lambda x, block: block(x), initial=embedded)
            for i, tokens in enumerate(rows):
                sums[i] += F.cosine_similarity(tokens[:, 0], tokens[:, 1], dim=-1).double().sum()
    return (sums / len(images)).tolist()
