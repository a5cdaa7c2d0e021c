"""DeiT's distillation through a distillation token (Touvron et al. 2021, "Training
data-efficient image transformers & distillation through attention", section 4), with the
teacher's hard labels or its softened outputs.

The student is a :class:`~vit_mnist.models.vit.VisionTransformer` built with
``distillation=True``: its CLS head learns the true labels, its distillation head what a
trained teacher says of the same (augmented) images.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def distillation_loss(
    cls_logits: torch.Tensor,
    dist_logits: torch.Tensor,
    labels: torch.Tensor,
    teacher_logits: torch.Tensor,
    label_smoothing: float = 0.0,
    tau: float | None = None,
) -> torch.Tensor:
    """Half the true labels' cross-entropy on the CLS head, half the teacher's term on the
    distillation head. With ``tau=None``, DeiT's L_global^hardDistill (section 4, the
    equation after eq. 2):

        1/2 CE(softmax(Z_s), y) + 1/2 CE(softmax(Z_s_dist), y_t),   y_t = argmax_c Z_t(c)

    With a temperature ``tau``, the teacher's term is the soft one of DeiT's eq. 2 (Hinton
    et al. 2015, "Distilling the Knowledge in a Neural Network", section 2), which keeps
    how sure the teacher is and which wrong classes it finds likely:

        1/2 CE(softmax(Z_s), y) + 1/2 tau^2 KL(softmax(Z_t / tau) || softmax(Z_s_dist / tau))

    The tau^2 keeps the soft term's gradients the size of the hard one's (Hinton et al.).

    Args:
        cls_logits: the CLS head's logits Z_s, (batch, classes).
        dist_logits: the distillation head's logits Z_s_dist, (batch, classes).
        labels: the true classes y, (batch,) int64.
        teacher_logits: the teacher's logits Z_t of the same images, (batch, classes); no
            gradient flows to the teacher.
        label_smoothing: applied to the true labels' term only; the teacher's term is the
            teacher's as it is.
        tau: the softmax temperature of the soft term, > 0; None: hard labels.

    Returns:
        The scalar loss, float32.
    """
    true_term = F.cross_entropy(cls_logits.float(), labels, label_smoothing=label_smoothing)
    teacher_logits = teacher_logits.detach().float()
    if tau is None:
        teacher_term = F.cross_entropy(dist_logits.float(), teacher_logits.argmax(dim=-1))
    else:
        teacher_term = tau**2 * F.kl_div(
            F.log_softmax(dist_logits.float() / tau, dim=-1),
            F.log_softmax(teacher_logits / tau, dim=-1),
            reduction="batchmean",
            log_target=True,
        )
    return (true_term + teacher_term) / 2
