"""What a trained model's attention and heads do, and how it does per class.

- :mod:`vit_mnist.analysis.attention`: attention maps, rollout, entropy, mean attention
  distance, and the pictures the TensorBoard callback and ``predict.py`` show;
- :mod:`vit_mnist.analysis.heads`: head ablation and importance (Michel et al. 2019);
- :mod:`vit_mnist.analysis.per_class`: per-class metrics, confusion matrix, errors.

Each function takes any :class:`~vit_mnist.models.vit.VisionTransformer` and any batch.
"""

from vit_mnist.analysis.attention import (
    attention_entropy,
    attention_report,
    attention_rollout,
    cls_attention,
    head_statistics,
    mean_attention_distance,
)
from vit_mnist.analysis.heads import head_importance, heads_zeroed

__all__ = [
    "attention_entropy",
    "attention_report",
    "attention_rollout",
    "cls_attention",
    "head_importance",
    "head_statistics",
    "heads_zeroed",
    "mean_attention_distance",
]
