"""Everything about one image at once, with any heads switched off: what the explorer shows.

:func:`explain_image` is the explorer's one call per change of the page: the prediction,
every layer's and head's attention, their entropy and mean attention distance, the
rollout and the class relevance of a chosen class, all computed with the same functions
that TensorBoard (:func:`~vit_mnist.analysis.attention.attention_report`), ``predict.py``
and ``eval.py analysis=heads`` (:func:`~vit_mnist.analysis.heads.heads_switched_off`) use.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from vit_mnist.analysis.attention import attention_report, attention_rollout, cls_attention
from vit_mnist.analysis.heads import heads_switched_off
from vit_mnist.analysis.relevance import class_relevance
from vit_mnist.models.vit import VisionTransformer


@dataclass
class ImageExplanation:
    """One image through a model with some heads switched off.

    Attributes:
        logits: (classes,) float32, with the heads off.
        probs: (classes,) float32 softmax of ``logits``.
        base_probs: (classes,) float32, every head on (equal to ``probs`` when none is off).
        weights: one (heads, tokens, tokens) float32 tensor per layer (``heads`` of that
            block: a pruned block has fewer), rows summing to 1; token 0 is CLS.
        cls_maps: one (heads, grid, grid) tensor per layer: the CLS row of ``weights``
            over the patches.
        entropy: one (heads,) tensor per layer, nats (this image's queries averaged).
        distance: one (heads,) tensor per layer, mean attention distance in pixels.
        rollout: (grid, grid) float32, the CLS row of the attention rollout (Abnar and
            Zuidema 2020) over the patches.
        relevance: (grid, grid) float32 >= 0, class relevance of ``target`` (Chefer, Gur
            and Wolf 2021).
        target: the class ``relevance`` explains (the predicted one unless chosen).
        grid_size: patches per image side.
    """

    logits: torch.Tensor
    probs: torch.Tensor
    base_probs: torch.Tensor
    weights: list[torch.Tensor]
    cls_maps: list[torch.Tensor]
    entropy: list[torch.Tensor]
    distance: list[torch.Tensor]
    rollout: torch.Tensor
    relevance: torch.Tensor
    target: int
    grid_size: int

    @property
    def predicted(self) -> int:
        """The class of highest probability, with the heads off."""
        return int(self.probs.argmax())

    def token_maps(self, layer: int, token: int) -> torch.Tensor:
        """(heads, grid, grid): where query ``token`` (see
        :func:`~vit_mnist.analysis.attention.cls_attention`) attends in ``layer``, per head,
        over the patches."""
        return cls_attention(self.weights[layer], self.grid_size, token)


def explain_image(
    model: VisionTransformer,
    image: torch.Tensor,
    *,
    heads_off: Iterable[tuple[int, int]] = (),
    target: int | None = None,
) -> ImageExplanation:
    """Run ``model`` on one image with ``heads_off`` zeroed and gather what the explorer shows.

    The attention comes from :func:`attention_report` (explicit path, eval mode), the
    relevance from :func:`class_relevance` (one forward and backward pass), both inside
    :func:`heads_switched_off`: the heads' outputs are zeroed before ``W^O`` exactly as
    ``eval.py analysis=heads`` zeroes one (Michel, Levy and Neubig 2019, eq. 1). With heads
    off, one more forward pass with every head on gives ``base_probs``.

    Args:
        model: a :class:`VisionTransformer`; its train/eval mode is restored.
        image: (1, C, H, W) or (C, H, W) float, normalised as the model was trained.
        heads_off: (layer, head) pairs, heads numbered within their block.
        target: the class the relevance explains; None: the predicted one.

    Returns:
        An :class:`ImageExplanation`, tensors on the CPU.

    Raises:
        ValueError: more than one image, a head the model lacks, or a target class outside
            the model's classes.
        RuntimeError: called inside :func:`torch.inference_mode` (relevance needs gradients).
    """
    x = image if image.ndim == 4 else image[None]
    if x.shape[0] != 1:
        raise ValueError(f"explain_image takes one image; got a batch of {x.shape[0]}")
    heads_off = sorted(set(heads_off))
    with heads_switched_off(model, heads_off):
        report = attention_report(model, x, relevance=False, pictures=False)
        relevance, classes = class_relevance(model, x, target)
    logits = report.logits[0]
    probs = logits.softmax(dim=-1)
    base_probs = probs
    if heads_off:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                device = next(model.parameters()).device
                base_probs = model(x.to(device)).float().cpu()[0].softmax(dim=-1)
        finally:
            model.train(was_training)
    grid = model.patch_embed.grid_size
    weights = [w[0] for w in report.weights]
    return ImageExplanation(
        logits=logits,
        probs=probs,
        base_probs=base_probs,
        weights=weights,
        cls_maps=[cls_attention(w, grid) for w in weights],
        entropy=report.entropy,
        distance=report.distance,
        rollout=cls_attention(attention_rollout(report.weights), grid)[0],
        relevance=relevance[0],
        target=int(classes[0]),
        grid_size=grid,
    )
