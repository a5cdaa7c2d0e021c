"""Direct logit attribution: what each head, each MLP and the embedding writes into the
class logits through the residual stream (Elhage et al. 2021, "A Mathematical Framework for
Transformer Circuits"; TransformerLens' ``ActivationCache.stack_head_results`` and
``logit_attrs``).

The CLS token's last residual stream is a sum of components r_c (embedding, each head's
``head_i W^O_i``, each MLP, the biases; :mod:`vit_mnist.analysis.components`). The head
reads it through the final LayerNorm and a linear map, ``y = W (gamma * (x - mu(x)) /
sigma(x) + beta) + b`` (ViT eq. 4). With ``sigma`` frozen at its value in the real forward
pass (``apply_ln_to_stack`` in TransformerLens), the map is linear in x, and component c's
direct contribution to the logits is

    W (gamma * (r_c - mean(r_c)) / sigma)

with ``W beta + b`` (and the W^O biases) given to the component ``biases``; the
contributions add up to the logits exactly. "Direct" means the path from the component
straight to the head: what it changes in later layers' inputs is not counted (activation
patching, :mod:`vit_mnist.analysis.patching`, counts it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vit_mnist.analysis.components import Components, head_counts, head_grid, read_components
from vit_mnist.models.vit import VisionTransformer


@dataclass
class LogitAttribution:
    """Direct contributions of every component to every class logit, per image.

    Attributes:
        names: the C component names: ``embed``, then per layer L ``L{L}H{i}`` for its heads
            and ``L{L} mlp``, then ``biases`` (every W^O bias, the final LayerNorm's beta
            and the head's bias).
        contributions: (N, C, K) float32: component c's direct contribution to logit k of
            image n; summed over c it is the CLS head's logits.
        logits: (N, K) float32, the CLS head's logits from the same forward pass.
        contributions_dist, logits_dist: the same for the distillation head (token 1) of a
            distilled model, else None. The distilled model's prediction is the two heads'
            softmax averaged, which is not a sum: read each head's own attribution.
        head_index: (total heads,) int64, the rows of ``contributions`` that are heads, in
            the order layer 0 head 0, layer 0 head 1, ...
        mlp_index: (depth,) int64, the rows that are MLPs.
        where: per component, its (layer, head) for a head, (layer, None) for an MLP and
            (None, None) for the embedding and the biases.
    """

    names: list[str]
    contributions: torch.Tensor
    logits: torch.Tensor
    contributions_dist: torch.Tensor | None
    logits_dist: torch.Tensor | None
    head_index: torch.Tensor
    mlp_index: torch.Tensor
    where: list[tuple[int | None, int | None]]

    def to_class(self, k: int | torch.Tensor) -> torch.Tensor:
        """(N, C): each component's direct contribution to logit ``k``, a class given as an
        int or an (N,) int64 tensor (one per image)."""
        k = torch.as_tensor(k).expand(len(self.contributions))
        return self.contributions.gather(2, k[:, None, None].expand(-1, len(self.names), 1))[..., 0]

    def logit_difference(self, a: int | torch.Tensor, b: int | torch.Tensor) -> torch.Tensor:
        """(N, C): each component's direct contribution to ``logit_a - logit_b``, for
        classes ``a`` and ``b`` given as ints or (N,) int64 tensors (one per image)."""
        return self.to_class(a) - self.to_class(b)

    def heads(self, model: VisionTransformer, values: torch.Tensor) -> torch.Tensor:
        """Per-component values (..., C) -> the heads' as (..., depth, max heads), NaN where
        a block has fewer heads."""
        return head_grid(model, values[..., self.head_index])


def _components(model: VisionTransformer) -> tuple[list[str], list[tuple[int | None, ...]]]:
    where = []
    for layer, count in enumerate(head_counts(model)):
        where += [*((layer, i) for i in range(count)), (layer, None)]
    names = [f"L{layer}H{i}" if i is not None else f"L{layer} mlp" for layer, i in where]
    return ["embed", *names, "biases"], [(None, None), *where, (None, None)]


def _through_head(
    model: VisionTransformer, c: Components, token: int, head: torch.nn.Linear
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, C, K) contributions of token ``token``'s components to ``head``, and its logits."""
    parts = [c.embed[:, token]]
    for heads, mlp in zip(c.heads, c.mlp, strict=True):
        parts += [*heads[:, :, token].unbind(1), mlp[:, token]]
    bias = torch.stack(c.attn_bias).sum(0).expand_as(parts[0])
    stack = torch.stack([*parts, bias], dim=1)  # (B, C, D)
    final = c.resid_post[-1][:, token]  # (B, D) = stack.sum(1)
    norm = model.norm
    # LayerNorm's sigma, frozen from the real pass (biased variance, as nn.LayerNorm).
    sigma = (final.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()  # (B, 1)
    centred = stack - stack.mean(-1, keepdim=True)
    out = (centred * norm.weight / sigma[:, None]) @ head.weight.T  # (B, C, K)
    out[:, -1] += head(norm.bias)  # W beta + b, once, with the biases
    return out, head(norm(final))


def attribution_of(model: VisionTransformer, c: Components) -> LogitAttribution:
    """The direct logit attribution of one forward pass's components
    (:func:`~vit_mnist.analysis.components.run_components`, whose head mask it follows: a
    head switched off contributes 0), on their device and in their autograd graph."""
    names, where = _components(model)
    contributions, logits = _through_head(model, c, 0, model.head)
    dist = (None, None) if model.head_dist is None else _through_head(model, c, 1, model.head_dist)
    return LogitAttribution(
        names=names,
        contributions=contributions,
        logits=logits,
        contributions_dist=dist[0],
        logits_dist=dist[1],
        head_index=torch.tensor([i for i, (_, h) in enumerate(where) if h is not None]),
        mlp_index=torch.tensor([i for i, name in enumerate(names) if name.endswith(" mlp")]),
        where=where,
    )


@torch.no_grad()
def direct_logit_attribution(
    model: VisionTransformer, images: torch.Tensor, *, batch_size: int = 500
) -> LogitAttribution:
    """Each component's direct contribution to every class logit, per image.

    The final LayerNorm is handled as TransformerLens' ``apply_ln_to_stack`` does: its
    scale ``sigma`` (the standard deviation of the CLS token's last residual stream, plus
    eps) is taken from the real forward pass and held fixed, which makes the head linear
    in the residual stream; the components then add up to the logits (float32 rounding,
    about 1e-6). The model runs in eval mode, in float32 with autocast off, on the device
    of its parameters; its mode is restored.

    Args:
        model: a :class:`VisionTransformer` (distilled and pruned ones included).
        images: (N, C, H, W) float, normalised as the model was trained; any device.
        batch_size: images per forward pass (memory, not results).

    Returns:
        :class:`LogitAttribution`, tensors on the CPU.
    """
    parts = read_components(model, images, lambda c: attribution_of(model, c), batch_size)

    def cat(name: str) -> torch.Tensor | None:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else torch.cat(values).float().cpu()

    per_image = ("contributions", "logits", "contributions_dist", "logits_dist")
    return replace(parts[0], **{name: cat(name) for name in per_image})


def margin_attribution(
    attribution: LogitAttribution, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each component's direct contribution to the true class and to the margin over the
    runner-up (the highest other logit), per image.

    Args:
        labels: (N,) int64 true classes.

    Returns:
        to_true (N, C) and to_margin (N, C) float32 (``logit_true - logit_runner_up``,
        summed over the components, is the image's margin; negative for an error), and the
        runner-up classes (N,) int64.
    """
    labels = labels.cpu().long()
    runner_up = attribution.logits.scatter(1, labels[:, None], float("-inf")).argmax(1)
    return attribution.to_class(labels), attribution.logit_difference(labels, runner_up), runner_up


def attribution_rows(
    attribution: LogitAttribution, labels: torch.Tensor, class_names: list[str]
) -> list[dict[str, object]]:
    """One row per component: ``component``, ``layer`` and ``head`` ("" where none),
    ``to_true`` and ``to_margin`` (:func:`margin_attribution`, means over all images, in
    logits), ``top_class`` (the class whose images it helps most over their runner-up),
    then ``to_margin_<class>`` and ``to_true_<class>`` (means over each true class's
    images; NaN for a class with none)."""
    to_true, to_margin, _ = margin_attribution(attribution, labels)
    labels = labels.cpu()
    onehot = torch.nn.functional.one_hot(labels, len(class_names)).double()  # (N, K)
    count = onehot.sum(0)

    def by_class(values: torch.Tensor) -> torch.Tensor:  # (N, C) -> (K, C) class means
        return ((onehot.T @ values.double()) / count[:, None]).float()

    margin_by_class, true_by_class = by_class(to_margin), by_class(to_true)
    rows = []
    for c, (name, (layer, head)) in enumerate(
        zip(attribution.names, attribution.where, strict=True)
    ):
        margin, true = margin_by_class[:, c], true_by_class[:, c]
        rows.append(
            {
                "component": name,
                "layer": "" if layer is None else layer,
                "head": "" if head is None else head,
                "to_true": round(float(to_true[:, c].mean()), 5),
                "to_margin": round(float(to_margin[:, c].mean()), 5),
                "top_class": class_names[int(margin.nan_to_num(float("-inf")).argmax())],
                **{f"to_margin_{n}": round(float(margin[k]), 5) for k, n in enumerate(class_names)},
                **{f"to_true_{n}": round(float(true[k]), 5) for k, n in enumerate(class_names)},
            }
        )
    return rows


def attribution_figure(
    model: VisionTransformer,
    attribution: LogitAttribution,
    per_image: torch.Tensor,
    labels: torch.Tensor,
    class_names: list[str],
    title: str,
):
    """Layers x (heads, MLP) heat maps of a per-image attribution (N, C) averaged over all
    images and over each true class, on one colour scale (red writes for the class, blue
    against it)."""
    groups = [("all", torch.ones(len(labels), dtype=torch.bool))]
    groups += [(name, labels.cpu() == k) for k, name in enumerate(class_names)]
    zero = torch.zeros_like(per_image[0])
    means = torch.stack(
        [per_image[chosen].mean(0) if chosen.any() else zero for _, chosen in groups]
    )
    return heads_and_mlp_figure(
        model,
        attribution.heads(model, means),
        means[:, attribution.mlp_index],
        titles=[f"{name} (n={int(chosen.sum())})" for name, chosen in groups],
        colorbar_label="direct contribution (logits)",
        title=title,
        columns=6,
    )


def heads_and_mlp_figure(
    model: VisionTransformer, heads: torch.Tensor, mlp: torch.Tensor, **panels
):
    """Layers x (heads, MLP) heat maps (:func:`~vit_mnist.analysis.drawing.heatmap_panels`, whose
    keywords ``panels`` passes on), one per panel, from ``heads`` (P, depth, max heads; NaN
    where a block lacks the head) and ``mlp`` (P, depth)."""
    from vit_mnist.analysis.drawing import heatmap_panels

    return heatmap_panels(
        torch.cat([heads, mlp[..., None]], dim=-1),
        row_labels=[f"layer {layer}" for layer in range(model.depth)],
        col_labels=[*map(str, range(heads.shape[-1])), "MLP"],
        x_label="head",
        **panels,
    )


def attribution_grid(
    model: VisionTransformer,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    class_names: list[str] | None = None,
    zoom: int = 20,
) -> torch.Tensor:
    """A picture of each image's heads: one layers x heads tile per image (rows = layers,
    columns = heads), the head's direct contribution to the true class's margin over the
    runner-up, red for, blue against, on one scale for every tile (named in the title).

    Args:
        images: (N, C, H, W) as the model takes them; labels: (N,) int64 true classes.
        zoom: screen pixels per cell.

    Returns:
        (3, height, width) uint8, for TensorBoard's ``add_image`` or a PNG.
    """
    from vit_mnist.analysis.drawing import diverging, labelled_grid

    attribution = direct_logit_attribution(model, images)
    _, to_margin, _ = margin_attribution(attribution, labels)
    grid = attribution.heads(model, to_margin)  # (N, depth, heads)
    finite = grid[grid.isfinite()].abs()
    limit = float(finite.max()) if finite.numel() else 1.0
    name = (lambda k: class_names[k]) if class_names else str
    predicted = attribution.logits.argmax(1).tolist()
    columns = [f"{name(int(y))}>{name(p)}" for y, p in zip(labels.tolist(), predicted, strict=True)]
    return labelled_grid(
        diverging(grid, limit)[None],
        row_labels=[""],
        col_labels=columns,
        title=(
            "heads' direct logit attribution to true - runner-up (rows: layers, columns: "
            f"heads; red +, blue -, full colour {limit:.2f})"
        ),
        zoom=zoom,
    )
