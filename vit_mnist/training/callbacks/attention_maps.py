"""Log per-head attention maps, rollout, class relevance and head statistics to TensorBoard
during training."""

from __future__ import annotations

import itertools
import logging

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only

from vit_mnist.analysis.attention import attention_report
from vit_mnist.analysis.logit_attribution import attribution_grid
from vit_mnist.errors import ConfigError
from vit_mnist.models.vit import VisionTransformer

log = logging.getLogger(__name__)


def panel_indices(labels: torch.Tensor, num_images: int) -> list[int]:
    """Indices of a panel of ``num_images`` images, one per class where possible.

    Round-robin over the classes in order: the first image of class 0, of class 1, ...,
    then the second image of each class, until the panel is full. The TensorBoard panel
    and the explorer's examples are this panel of the validation set, so the two show the
    same digits.

    Args:
        labels: (N,) integer classes, in the dataset's order.
        num_images: panel size; fewer when the dataset is smaller.
    """
    by_class = [torch.nonzero(labels == c).flatten().tolist() for c in labels.unique().tolist()]
    rounds = itertools.zip_longest(*by_class)  # (first of each class), (second of each), ...
    return list(itertools.islice((i for row in rounds for i in row if i is not None), num_images))


class AttentionMapLogger(L.Callback):
    """Every ``every_n_epochs`` validation epochs and at the end of fitting, log what the
    heads of every layer attend to on a fixed panel of validation images.

    The panel is chosen once (:func:`panel_indices`): the first validation image of each
    class in turn (one per class where possible), then the next ones, ``num_images`` in
    all; the validation set is not shuffled, so it is the same panel every epoch and every
    run, and the explorer's first examples.

    The maps come from the explicit attention path, in eval mode, on the panel only, after
    the validation epoch: the training step keeps whatever attention implementation was
    configured and pays nothing. The relevance row takes one forward and backward pass on
    the panel, with gradients enabled (outside inference mode) but taken with respect to
    the attention weights only: no parameter's ``.grad`` and no optimizer state is touched.

    TensorBoard tags (L = layer, H = head, both from 0):

    - ``attention/layer_L``: image; heads as rows, panel images as columns, the CLS
      token's attention over the patches overlaid on each digit (then, in a distilled
      model, the distillation token's, rows ``dist. head H``); labels ``true>predicted``.
    - ``attention_matrix/layer_L/head_H``: image; the token-by-token attention matrix
      (row = query, column = key, token 0 = CLS) of the first panel image.
    - ``rollout``: image; two rows, attention rollout and the class relevance of the
      predicted class (Chefer et al. 2021), overlaid on each panel image.
    - ``attribution``: image; per panel image, each head's direct logit attribution
      (Elhage et al. 2021) to the true class's margin over the runner-up, as a layers x
      heads tile: what the heads write, beside where they look (one more forward pass).
    - ``attention_entropy/layer_L/head_H``: scalar, nats, averaged over query tokens and
      panel images.
    - ``attention_distance/layer_L/head_H``: scalar, mean attention distance in pixels.

    A model without attention (``model=cnn``, the convnet teacher) logs none of these.

    Args:
        num_images: panel size.
        every_n_epochs: log after every n-th validation epoch (and always at the end).
        zoom: magnification of each 28 x 28 tile.

    Raises:
        ConfigError: ``num_images`` or ``every_n_epochs`` below 1.
    """

    def __init__(self, *, num_images: int = 10, every_n_epochs: int = 1, zoom: int = 3) -> None:
        if num_images < 1 or every_n_epochs < 1:
            raise ConfigError(
                f"callbacks.attention_maps: num_images={num_images} and "
                f"every_n_epochs={every_n_epochs} must be >= 1"
            )
        self.num_images = num_images
        self.every_n_epochs = every_n_epochs
        self.zoom = zoom
        self._panel: tuple[torch.Tensor, torch.Tensor] | None = None
        self._last_logged_step: int | None = None

    def _select_panel(self, trainer: L.Trainer) -> tuple[torch.Tensor, torch.Tensor]:
        loaders = trainer.val_dataloaders
        loader = loaders[0] if isinstance(loaders, list | tuple) else loaders
        dataset = loader.dataset
        tensors = getattr(dataset, "tensors", None)
        labels = (
            tensors[1]
            if tensors
            else torch.tensor([int(dataset[i][1]) for i in range(len(dataset))])
        )
        chosen = panel_indices(labels, self.num_images)
        images = torch.stack([torch.as_tensor(dataset[i][0]) for i in chosen])
        return images, labels[chosen]

    @rank_zero_only
    def _log(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        writer = next(
            (lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None
        )
        step = trainer.global_step
        net = getattr(pl_module, "net", pl_module)
        no_attention = not isinstance(net, VisionTransformer)  # the convnet teacher
        if writer is None or step == self._last_logged_step or no_attention:
            return
        if self._panel is None:
            self._panel = self._select_panel(trainer)
        images, labels = self._panel
        class_names = getattr(getattr(trainer, "datamodule", None), "class_names", None)
        # The relevance maps need gradients: Lightning's fit loop validates under no_grad
        # (trainer.validate under inference mode); the panel may have been stacked in there.
        with torch.inference_mode(False):
            report = attention_report(
                net, images.clone(), labels, class_names=class_names, zoom=self.zoom
            )
            attribution = attribution_grid(net, images.clone(), labels, class_names=class_names)
        for layer, grid in enumerate(report.layer_grids):
            writer.add_image(f"attention/layer_{layer}", grid, step)
            for head, matrix in enumerate(report.matrices[layer]):
                writer.add_image(f"attention_matrix/layer_{layer}/head_{head}", matrix, step)
            for head in range(len(report.entropy[layer])):
                tag = f"layer_{layer}/head_{head}"
                writer.add_scalar(f"attention_entropy/{tag}", report.entropy[layer][head], step)
                writer.add_scalar(f"attention_distance/{tag}", report.distance[layer][head], step)
        writer.add_image("rollout", report.rollout, step)
        writer.add_image("attribution", attribution, step)
        self._last_logged_step = step

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Only the validation epochs inside fit(): not the sanity check, not trainer.validate().
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        if (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self._log(trainer, pl_module)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.val_dataloaders is not None:
            self._log(trainer, pl_module)
