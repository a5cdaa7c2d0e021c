"""What a trained model's attention and heads do, and how it does per class.

- :mod:`vit_mnist.analysis.attention`: attention maps, rollout, entropy, mean attention
  distance, and the pictures the TensorBoard callback and ``predict.py`` show;
- :mod:`vit_mnist.analysis.relevance`: class relevance maps (Chefer, Gur and Wolf 2021);
- :mod:`vit_mnist.analysis.heads`: head ablation and gradient head importance (Michel et
  al. 2019);
- :mod:`vit_mnist.analysis.pruning`: head pruning, heads cut out of the weights (Michel et
  al. 2019, section 4);
- :mod:`vit_mnist.analysis.faithfulness`: the perturbation test of explanations;
- :mod:`vit_mnist.analysis.per_class`: per-class metrics, confusion matrix, errors;
- :mod:`vit_mnist.analysis.distillation`: the distillation token beside the CLS token (DeiT);
- :mod:`vit_mnist.analysis.explain`: all of the above for one image with heads switched
  off, as the explorer shows it;
- what heads write, not where they look: :mod:`vit_mnist.analysis.components` (the
  residual stream as a sum of the embedding, each head, each MLP), direct logit attribution
  (:mod:`vit_mnist.analysis.logit_attribution`), activation patching
  (:mod:`vit_mnist.analysis.patching`) and the logit lens (:mod:`vit_mnist.analysis.logit_lens`).

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
from vit_mnist.analysis.distillation import cls_dist_similarity
from vit_mnist.analysis.explain import ImageExplanation, explain_image
from vit_mnist.analysis.faithfulness import explanation_maps, perturbation_test
from vit_mnist.analysis.heads import (
    gradient_head_importance,
    head_importance,
    heads_switched_off,
    heads_zeroed,
)
from vit_mnist.analysis.logit_attribution import direct_logit_attribution
from vit_mnist.analysis.logit_lens import logit_lens
from vit_mnist.analysis.patching import activation_patching
from vit_mnist.analysis.pruning import prune_heads, prune_in_order
from vit_mnist.analysis.relevance import class_relevance

__all__ = [
    "ImageExplanation",
    "activation_patching",
    "direct_logit_attribution",
    "logit_lens",
    "attention_entropy",
    "attention_report",
    "attention_rollout",
    "class_relevance",
    "cls_dist_similarity",
    "explain_image",
    "cls_attention",
    "explanation_maps",
    "gradient_head_importance",
    "head_importance",
    "head_statistics",
    "heads_switched_off",
    "heads_zeroed",
    "mean_attention_distance",
    "perturbation_test",
    "prune_heads",
    "prune_in_order",
]
