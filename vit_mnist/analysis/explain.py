"""Everything about one image at once, with any heads switched off: what the explorer shows.

:func:`explain_image` is the explorer's one call per change of the page: the prediction,
every layer's and head's attention, their entropy and mean attention distance, the
rollout, the class relevance of a chosen class, what each head writes into each class
logit and the logit lens, in one forward and backward pass.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from vit_mnist.analysis.attention import (
    attention_entropy,
    attention_rollout,
    cls_attention,
    mean_attention_distance,
)
from vit_mnist.analysis.components import head_grid, head_mask, run_components
from vit_mnist.analysis.logit_attribution import attribution_of
from vit_mnist.analysis.logit_lens import lens_logits
from vit_mnist.analysis.relevance import relevance_rule
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
        heads_off: the (layer, head) pairs switched off, sorted.
        attribution: (components, classes) float32, each component's direct contribution
            to each class logit with the heads off (a head off gives 0; the rows of
            :func:`~vit_mnist.analysis.logit_attribution.direct_logit_attribution`, the CLS
            head's for a distilled model); the rows add up to the logits.
        head_index: the rows of ``attribution`` that are heads, layer by layer.
        head_grid: (depth, max heads) bool, where a block has that head (a pruned block
            has fewer).
        lens: (depth, classes) float32, the logit lens: the class probabilities read from
            the CLS token after each block (with the heads off).
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
    heads_off: list[tuple[int, int]] = field(default_factory=list)
    attribution: torch.Tensor | None = None
    head_index: torch.Tensor | None = None
    head_grid: torch.Tensor | None = None
    lens: torch.Tensor | None = None

    @property
    def predicted(self) -> int:
        """The class of highest probability, with the heads off."""
        return int(self.probs.argmax())

    def head_attribution(self, a: int, b: int | None = None) -> torch.Tensor:
        """(depth, max heads) float32: each head's direct contribution to logit ``a`` (or to
        ``logit_a - logit_b``), NaN where a block lacks the head."""
        values = self.attribution[self.head_index, a]
        if b is not None:
            values = values - self.attribution[self.head_index, b]
        grid = torch.full(self.head_grid.shape, float("nan"))
        grid[self.head_grid] = values
        return grid

    def token_maps(self, layer: int, token: int) -> torch.Tensor:
        """(heads, grid, grid): where query ``token`` (see
        :func:`~vit_mnist.analysis.attention.cls_attention`) attends in ``layer``, per head,
        over the patches."""
        return cls_attention(self.weights[layer], self.grid_size, token)


def _one_image(model: VisionTransformer, image: torch.Tensor, target: int | None) -> torch.Tensor:
    """``image`` as a batch of one (1, C, H, W), checked with ``model`` and ``target`` for
    :func:`explain_image`, which raises what this raises."""
    x = image if image.ndim == 4 else image[None]
    if x.shape[0] != 1:
        raise ValueError(f"explain_image takes one image; got a batch of {x.shape[0]}")
    if model.training:
        raise ValueError("explain_image needs the model in eval mode: call model.eval() first")
    if torch.is_inference_mode_enabled():
        raise RuntimeError("explain_image needs gradients; call it outside torch.inference_mode")
    classes = model.head.out_features
    if target is not None and not 0 <= target < classes:
        raise ValueError(f"target class {target} is outside 0..{classes - 1}")
    return x


def explain_image(
    model: VisionTransformer,
    image: torch.Tensor,
    *,
    heads_off: Iterable[tuple[int, int]] = (),
    target: int | None = None,
) -> ImageExplanation:
    """Run ``model`` on one image with ``heads_off`` zeroed and gather what the explorer shows.

    One forward and one backward pass of :func:`run_components` (the model's own modules,
    every head's output kept): the heads are switched off by its head mask (each head's
    output zeroed before ``W^O``, as ``eval.py analysis=heads``' :func:`heads_zeroed` does:
    Michel, Levy and Neubig 2019, eq. 1), and with heads off the image is run a second
    time in the same batch with every head on, for ``base_probs``. The attention
    statistics are :func:`attention_report`'s (:func:`attention_entropy`,
    :func:`mean_attention_distance`, :func:`attention_rollout`), the relevance is
    :func:`class_relevance`'s rule (:func:`relevance_rule`), the attribution
    :func:`~vit_mnist.analysis.logit_attribution.direct_logit_attribution`'s and the lens
    :func:`~vit_mnist.analysis.logit_lens.logit_lens`', all from that pass.

    Nothing of the call is left on ``model``, not even for its duration (no hook, no
    train/eval switch, no ``.grad``): calls with different heads off may share one model
    in several threads at once.

    Args:
        model: a :class:`VisionTransformer` in eval mode.
        image: (1, C, H, W) or (C, H, W) float, normalised as the model was trained.
        heads_off: (layer, head) pairs, heads numbered within their block.
        target: the class the relevance explains; None: the predicted one.

    Returns:
        An :class:`ImageExplanation`, tensors on the CPU.

    Raises:
        ValueError: more than one image, a model in training mode, a head the model lacks,
            or a target class outside the model's classes.
        RuntimeError: called inside :func:`torch.inference_mode` (relevance needs gradients).
    """
    x = _one_image(model, image, target)
    heads_off = sorted(set(heads_off))
    mask = head_mask(model, heads_off)[None]
    parameter = next(model.parameters())
    if heads_off:  # row 0 with the heads off, row 1 with every head on
        mask = torch.cat([mask, torch.ones_like(mask)])
        x = torch.cat([x, x])
    # A leaf of its own (not the caller's tensor) that requires grad: the graph exists even
    # when the parameters are frozen; only the attention weights' gradients are taken.
    x = x.to(parameter.device, parameter.dtype).detach().requires_grad_(True)
    with torch.enable_grad(), torch.autocast(parameter.device.type, enabled=False):
        c = run_components(model, x, head_mask=mask.to(x))
        explained = int(c.logits[0].argmax()) if target is None else int(target)
        grads = torch.autograd.grad(c.logits[0, explained], c.weights)
    with torch.no_grad():
        attribution = attribution_of(model, c)
        lens = lens_logits(model, c)[0].float().softmax(-1).cpu()
    grid, patch = model.patch_embed.grid_size, model.patch_embed.patch_size
    relevance = relevance_rule([w[:1] for w in c.weights], [g[:1] for g in grads], grid)
    weights = [w[:1].detach().float().cpu() for w in c.weights]
    probs = c.logits.detach().float().cpu().softmax(dim=-1)
    return ImageExplanation(
        logits=c.logits[0].detach().float().cpu(),
        probs=probs[0],
        base_probs=probs[-1],
        weights=[w[0] for w in weights],
        cls_maps=[cls_attention(w[0], grid) for w in weights],
        entropy=[attention_entropy(w) for w in weights],
        distance=[mean_attention_distance(w, grid_size=grid, patch_size=patch) for w in weights],
        rollout=cls_attention(attention_rollout(weights), grid)[0],
        relevance=relevance[0].detach().float().cpu(),
        target=explained,
        grid_size=grid,
        heads_off=heads_off,
        attribution=attribution.contributions[0].float().cpu(),
        head_index=attribution.head_index,
        head_grid=head_grid(model, torch.ones(len(attribution.head_index))).isfinite(),
        lens=lens,
    )
