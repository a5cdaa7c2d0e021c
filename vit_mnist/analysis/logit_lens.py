"""The logit lens: the class the CLS token's residual stream already holds after each block
(nostalgebraist 2020, "interpreting GPT: the logit lens"; for ViTs, ViT-Prisma's
``HookedViT`` tutorials).

After block l the residual stream z_l is read as if it were the last one, through the
model's own final LayerNorm and head (ViT eq. 4): ``y_l = head(LN(z_l^0))``. The layer from
which ``y_l`` names the right class, and agrees with the model's own answer, is where the
decision has been written; after the last block it is the model's prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vit_mnist.analysis.components import Components, read_components
from vit_mnist.models.vit import VisionTransformer


@dataclass
class LogitLens:
    """The logit lens of a batch.

    Attributes:
        logits: (N, depth, K) float32, the head's reading after each block (a distilled
            model: its two heads averaged, as its forward does).
        predictions: (N, depth) int64, their argmax; ``predictions[:, -1]`` is the model's.
        agreement: (depth,) float32, the share of images whose reading after the block is
            the model's final prediction.
        accuracy: (depth,) float32, the share equal to the label; None without labels.
        class_accuracy: (depth, K) float32, ``accuracy`` per true class (NaN for a class
            with no image); None without labels.
    """

    logits: torch.Tensor
    predictions: torch.Tensor
    agreement: torch.Tensor
    accuracy: torch.Tensor | None = None
    class_accuracy: torch.Tensor | None = None

    def rows(self, class_names: list[str]) -> list[dict[str, object]]:
        """One row per block: ``layer``, ``agreement``, and with labels ``accuracy`` and
        ``acc_<class>`` (fractions)."""
        rows = []
        for layer, agreement in enumerate(self.agreement.tolist()):
            row: dict[str, object] = {"layer": layer, "agreement": round(agreement, 6)}
            if self.accuracy is not None and self.class_accuracy is not None:
                row["accuracy"] = round(float(self.accuracy[layer]), 6)
                for k, name in enumerate(class_names):
                    row[f"acc_{name}"] = round(float(self.class_accuracy[layer, k]), 6)
            rows.append(row)
        return rows


def lens_logits(model: VisionTransformer, c: Components) -> torch.Tensor:
    """(B, depth, K): the head's reading of the residual stream after each block of one
    forward pass (:func:`~vit_mnist.analysis.components.run_components`)."""
    return torch.stack([model.forward_head(model.norm(z)) for z in c.resid_post], dim=1)


@torch.no_grad()
def logit_lens(
    model: VisionTransformer,
    images: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    batch_size: int = 500,
) -> LogitLens:
    """Read the class from the CLS token's residual stream after every block.

    The model runs in eval mode in float32 with autocast off, on its parameters' device;
    its mode is restored.

    Args:
        model: a :class:`VisionTransformer` (distilled and pruned ones included).
        images: (N, C, H, W) float, normalised as the model was trained.
        labels: (N,) int64 true classes, or None.
        batch_size: images per forward pass (memory, not results).

    Returns:
        :class:`LogitLens`, on the CPU.
    """
    readings = read_components(model, images, lambda c: lens_logits(model, c).cpu(), batch_size)
    logits = torch.cat(readings).float()
    predictions = logits.argmax(-1)
    lens = LogitLens(
        logits=logits,
        predictions=predictions,
        agreement=(predictions == predictions[:, -1:]).float().mean(0),
    )
    if labels is not None:
        right = (predictions == labels.cpu()[:, None]).float()  # (N, L)
        lens.accuracy = right.mean(0)
        classes = logits.shape[-1]
        onehot = torch.nn.functional.one_hot(labels.cpu(), classes).float()  # (N, K)
        lens.class_accuracy = (right.T @ onehot) / onehot.sum(0)  # NaN for an absent class
    return lens


def lens_figure(lens: LogitLens, class_names: list[str], title: str):
    """The lens curve: accuracy against the labels and agreement with the final prediction
    after each block (%), and each class's accuracy as a thin line."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    layers = range(len(lens.agreement))
    fig = Figure(figsize=(5.5, 3.6), dpi=110, layout="constrained")
    ax = fig.subplots()
    if lens.class_accuracy is not None:
        colours = colormaps["tab10"]
        for k, name in enumerate(class_names):
            accuracy = 100 * lens.class_accuracy[:, k]
            ax.plot(layers, accuracy, lw=0.8, alpha=0.6, color=colours(k % 10), label=name)
        ax.plot(layers, 100 * lens.accuracy, lw=2.5, color="black", label="accuracy")
    ax.plot(layers, 100 * lens.agreement, lw=2, ls="--", color="grey", label="= final prediction")
    ax.set_xticks(list(layers), [f"after {layer}" for layer in layers], fontsize=7)
    ax.set(ylim=(0, 101), xlabel="block", ylabel="% of images")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6, ncol=2, loc="lower right")
    return fig
