"""Class relevance maps: which patches speak for a class (Chefer, Gur and Wolf 2021).

Chefer, Gur and Wolf 2021, "Generic Attention-model Explainability for Interpreting
Bi-Modal and Encoder-Decoder Transformers" (ICCV), the rule for self-attention:

    R_0 = I                                    (tokens x tokens; section 3.1, eq. 1)
    A-bar_l = E_h[(grad_{A_l} y_c * A_l)^+]    (* elementwise, ^+ = max(0, .); eq. 5)
    R_l = R_{l-1} + A-bar_l R_{l-1}            (layers l = 1 .. L, in order; eq. 6)

and the relevance map of class c is the CLS row of R_L over the patch tokens. Unlike
attention rollout (:func:`vit_mnist.analysis.attention.attention_rollout`), which is the
same whatever class one asks about, the gradient of the class logit ``y_c`` weights each
head's attention by how much it moves that logit, and keeps only what speaks for c.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from einops import rearrange

from vit_mnist.analysis.modes import evaluating
from vit_mnist.models.vit import VisionTransformer


def _targets(target: int | torch.Tensor | None, n: int, num_classes: int) -> torch.Tensor | None:
    """``target`` as an (n,) int64 CPU tensor, or None for the predicted classes."""
    if target is None:
        return None
    if isinstance(target, bool) or not isinstance(target, int | torch.Tensor):
        raise ValueError(f"target={target!r} must be None, an int or a ({n},) tensor of ints")
    target = torch.as_tensor(target)
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise ValueError(f"target must hold integer classes, got dtype {target.dtype}")
    if target.ndim and target.shape != (n,):
        raise ValueError(f"target of shape {tuple(target.shape)} for {n} images; want ({n},)")
    target = target.to("cpu", torch.int64).expand(n)
    bad = (target < 0) | (target >= num_classes)
    if bad.any():
        raise ValueError(
            f"target class {int(target[bad][0])} is outside 0..{num_classes - 1} "
            f"(the model has {num_classes} classes)"
        )
    return target


def class_relevance(
    model: VisionTransformer,
    images: torch.Tensor,
    target: int | torch.Tensor | None = None,
    *,
    batch_size: int = 250,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Class relevance map of each image (Chefer, Gur and Wolf 2021, eq. 5-6).

    Per layer l, in order: ``A-bar_l = mean_h((dy_c/dA_l * A_l).clamp(min=0))`` and
    ``R <- R + A-bar_l R`` from ``R = I``; the map is ``R[CLS, patches]`` on the patch
    grid. ``A_l`` are the attention weights (after the softmax, before dropout) that
    :meth:`VisionTransformer.forward_with_attention` returns: they are part of the autograd
    graph (not detached), and that method runs the explicit attention path whatever
    ``attention_impl`` the model was built with, so a fused model gives the same maps as
    an explicit one without any hook.

    Every image gets its own gradient: the selected logits are summed over the batch
    before the backward pass, and images do not interact in the model (eval mode: no
    dropout, LayerNorm per token), so ``d(sum_b y_b)/dA_b = dy_b/dA_b``; a batch gives the
    maps that one image at a time would.

    The model runs in eval mode with autocast off, on the device and in the dtype of its
    parameters (float32 for a trained model); its train/eval mode is restored afterwards.
    Gradients are taken with :func:`torch.autograd.grad` with respect to the attention
    weights only, so no parameter's ``.grad`` is touched (nor computed), and frozen
    parameters are fine.

    With ``causal=True`` the CLS token (token 0) sees only itself, the logits do not
    depend on the patches, and every map is 0.

    Args:
        model: a :class:`VisionTransformer` (token 0 the CLS token).
        images: (N, in_chans, H, W) float, normalised as the model was trained; any device.
        target: the class whose logit ``y_c`` is explained: None for each image's
            predicted class (argmax of its logits), an int for one class for every image,
            or an (N,) integer tensor, one class per image.
        batch_size: images per forward/backward pass (memory, not results).

    Returns:
        relevance (N, grid, grid) float32 on the CPU, ``grid = H // patch_size``, >= 0
        (row-major patch order, as the image), not normalised; and the explained classes
        (N,) int64 on the CPU (the predicted ones when ``target`` is None).

    Raises:
        ValueError: ``target`` is not None / int / (N,) integer tensor, or names a class
            outside ``0 .. num_classes - 1``.
        RuntimeError: called inside :func:`torch.inference_mode`, where no gradient can
            be taken.
    """
    if torch.is_inference_mode_enabled():
        raise RuntimeError("class_relevance needs gradients; call it outside torch.inference_mode")
    n = images.shape[0]
    targets = _targets(target, n, model.head.out_features)
    grid = model.patch_embed.grid_size
    parameter = next(model.parameters())
    device, dtype = parameter.device, parameter.dtype
    maps, classes = [], []
    with evaluating(model), torch.enable_grad(), torch.autocast(device.type, enabled=False):
        for start in range(0, n, batch_size):
            rows = slice(start, start + batch_size)
            # The input requires grad so that the graph exists even when the caller
            # has frozen the parameters; only the weights' gradients are computed.
            x = images[rows].to(device, dtype).requires_grad_(True)
            logits, weights = model.forward_with_attention(x)
            c = logits.argmax(dim=1) if targets is None else targets[rows].to(device)
            score = logits.gather(1, c[:, None]).sum()  # sum_b y_{b, c_b}
            grads = torch.autograd.grad(score, weights)
            maps.append(relevance_rule(weights, grads, grid).cpu())
            classes.append(c.cpu())
    return torch.cat(maps).float(), torch.cat(classes).to(torch.int64)


def relevance_rule(
    weights: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], grid_size: int
) -> torch.Tensor:
    """Chefer, Gur and Wolf 2021, eq. 5-6, from each layer's attention weights ``A_l`` and
    the gradient of the explained logit ``dy_c/dA_l``: ``R <- R + mean_h((dy_c/dA_l *
    A_l)^+) R`` from ``R = I``, and the CLS row of ``R`` over the patches.

    Args:
        weights, grads: one (B, heads, tokens, tokens) tensor each per layer, in order.
        grid_size: patches per image side (the patches are the last ``grid_size**2``
            tokens).

    Returns:
        (B, grid_size, grid_size) relevance >= 0, on the tensors' device and in their dtype.
    """
    tokens = weights[0].shape[-1]
    eye = torch.eye(tokens, device=weights[0].device, dtype=weights[0].dtype)
    r = eye.expand(len(weights[0]), tokens, tokens)
    for a, g in zip(weights, grads, strict=True):
        a_bar = (g * a.detach()).clamp(min=0).mean(dim=1)  # (B, T, T), eq. 5
        r = r + a_bar @ r  # eq. 6
    patches = r[:, 0, -(grid_size**2) :]  # the patches: the last tokens
    return rearrange(patches, "n (gh gw) -> n gh gw", gh=grid_size)
