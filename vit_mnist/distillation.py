"""DeiT's hard-label distillation (Touvron et al. 2021, "Training data-efficient image
transformers & distillation through attention", section 4).

The student is a :class:`~vit_mnist.models.vit.VisionTransformer` built with
``distillation=True``: its CLS head learns the true labels, its distillation head the
labels a trained teacher gives the same (augmented) images.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def hard_distillation_loss(
    cls_logits: torch.Tensor,
    dist_logits: torch.Tensor,
    labels: torch.Tensor,
    teacher_logits: torch.Tensor,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """DeiT's L_global^hardDistill (section 4, the equation after eq. 2):

        1/2 CE(softmax(Z_s), y) + 1/2 CE(softmax(Z_s_dist), y_t),   y_t = argmax_c Z_t(c)

    Args:
        cls_logits: the CLS head's logits Z_s, (batch, classes).
        dist_logits: the distillation head's logits Z_s_dist, (batch, classes).
        labels: the true classes y, (batch,) int64.
        teacher_logits: the teacher's logits Z_t of the same images, (batch, classes); only
            their argmax is used (no gradient flows to the teacher).
        label_smoothing: applied to the true labels' term only; DeiT's hard labels are the
            teacher's decision as it is.

    Returns:
        The scalar loss, float32.
    """
    teacher_labels = teacher_logits.detach().argmax(dim=-1)
    true_term = F.cross_entropy(cls_logits.float(), labels, label_smoothing=label_smoothing)
    return (true_term + F.cross_entropy(dist_logits.float(), teacher_labels)) / 2
