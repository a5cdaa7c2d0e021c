"""The LightningModule: loss, metrics, optimizer and learning-rate schedule around the ViT."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch import nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from vit_mnist.errors import ConfigError, NonFiniteLossError
from vit_mnist.models import build_model
from vit_mnist.models.vit import average_heads
from vit_mnist.training.distillation import distillation_loss
from vit_mnist.training.schedule import adamw_warmup_cosine

RUN_INFO_KEY = "vit_mnist"


class ViTClassifier(L.LightningModule):
    """Trains a :class:`~vit_mnist.models.vit.VisionTransformer` with cross-entropy and AdamW.

    Every argument is a plain value, saved with ``save_hyperparameters`` into each
    checkpoint, so ``ViTClassifier.load_from_checkpoint(path)`` rebuilds the model
    without the Hydra config.

    Args:
        model: the network's arguments (:func:`~vit_mnist.models.build_model`): a
            ``VisionTransformer``'s (``patch_size``, ``embed_dim``, ``depth``, ...), or with
            ``arch="cnn"`` the convnet teacher's (``img_size``, ``in_chans``, ``num_classes``).
        lr: peak learning rate of AdamW.
        weight_decay: AdamW's decoupled weight decay, applied to weight matrices only
            (not to biases, norms, ``cls_token`` or ``pos_embed``).
        betas: AdamW's betas.
        warmup_epochs: epochs (may be fractional) of linear warm-up.
        min_lr_ratio: final learning rate of the cosine decay, as a fraction of ``lr``.
        schedule_epochs: epochs the warm-up and cosine are laid out over; None: the
            trainer's ``max_epochs``. With more than ``max_epochs`` the run is the first
            part of a longer one, learning rate for learning rate: a study's trial that
            ranks configurations as their full runs do (docs/results.md, "which short run
            ranks configurations as the full run does").
        label_smoothing: cross-entropy label smoothing in [0, 1).
        test_time_shift: test-time augmentation, in pixels: a positive ``s`` makes the
            test step and ``predict_step`` score the log of the softmax averaged over 9
            copies of each image shifted by every (dx, dy) in {-s, 0, s}^2 (borders
            repeated); 0 classifies each image once. Validation stays one view. The
            ten-crop average of Krizhevsky et al. 2012 (section 4.1) with Simard et al.
            2003's shifts (section 2).
        teacher_ckpt: a checkpoint of this project whose outputs the distillation token
            learns (vit_mnist/training/distillation.py); needs ``model["distillation"]``.
            None: none.
        distillation_tau: None: the distillation token learns the teacher's hard labels
            (DeiT's hard distillation); a temperature > 0: its softened outputs (DeiT's
            eq. 2, Hinton et al. 2015).

    Logged: ``train/loss`` (per step), ``train/acc``, ``val/loss``, ``val/acc``,
    ``val/acc_best``, ``test/loss`` and ``test/acc`` (per epoch; accuracies are
    fractions in [0, 1]); with ``test_time_shift`` > 0 also ``test/acc_one_view``, the
    accuracy of the unshifted image alone.

    Each value's type and range is the settings schema's (``ModuleSettings``), checked
    with the whole config before anything is built.

    Raises:
        ConfigError: an impossible model, see :func:`~vit_mnist.models.checks.check_vit_args`.
    """

    def __init__(
        self,
        *,
        model: dict[str, Any],
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        betas: tuple[float, float] | list[float] = (0.9, 0.999),
        warmup_epochs: float = 1.0,
        min_lr_ratio: float = 0.01,
        schedule_epochs: float | None = None,
        label_smoothing: float = 0.0,
        test_time_shift: int = 0,
        teacher_ckpt: str | None = None,
        distillation_tau: float | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = build_model(model)
        # The training and test steps' forward of self.net: the model's own, unless the
        # speed layer (vit_mnist.speed.choose.prepare_speed, called by train()) puts the
        # path it chose here; a plain callable, not a module, so checkpoints hold net.* alone.
        self.step_forward: Callable[..., Any] = self.reference_forward
        self.criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        # Loaded when fitting starts; outside the module tree, so not in the checkpoints.
        self.teacher: Callable[[torch.Tensor], torch.Tensor] | None = None
        classes = model.get("num_classes", 10)
        self.train_acc, self.val_acc, self.test_acc, self.test_acc_one_view = (
            MulticlassAccuracy(num_classes=classes, average="micro") for _ in range(4)
        )
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self.val_acc_best = MaxMetric()
        self.run_info: dict[str, Any] = {}  # data config, precision, seed: from train()
        # One image, for Lightning's model summary: its FLOPs column and total count one
        # image's forward (without it they said 0), and its sizes columns the shapes.
        size = model.get("img_size", 28)
        self.example_input_array = torch.zeros(1, model.get("in_chans", 1), size, size)
        self._resumed_val_acc_best: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, 1, 28, 28) float -> logits (B, num_classes), by the reference model."""
        return self.net(x)

    def reference_forward(self, x: torch.Tensor, heads: bool = False) -> Any:
        """The model's own forward, as every speed path computes it: logits (B,
        num_classes), or with ``heads`` a distilled ViT's two heads' logits."""
        return self.net.forward_heads(self.net.forward_features(x)) if heads else self.net(x)

    def on_fit_start(self) -> None:
        self._check_weight_averaging()
        path = self.hparams.teacher_ckpt
        if path and self.teacher is None:  # channels_last: the convnet's forward 1.8x faster
            net = type(self).load_from_checkpoint(path, map_location=self.device, weights_only=True)
            net = net.net.eval().requires_grad_(False).to(memory_format=torch.channels_last)
            self.teacher = lambda x: net(x.contiguous(memory_format=torch.channels_last))

    def _check_weight_averaging(self) -> None:
        """An EMA of the weights (``callbacks.ema``, Lightning's ``EMAWeightAveraging``) that
        would start after this run's last step or epoch is never updated, and validation,
        the checkpoints and the test would then use the weights the run started from.

        Raises:
            ConfigError: such a start, naming it, the run's length and the fix.
        """
        from lightning.pytorch.callbacks import EMAWeightAveraging

        steps, epochs = self.trainer.estimated_stepping_batches, self.trainer.max_epochs
        for callback in self.trainer.callbacks:
            if not isinstance(callback, EMAWeightAveraging):
                continue
            step, epoch = callback.update_starting_at_step, callback.update_starting_at_epoch
            late = None
            if step is not None and step >= steps:
                late = f"update_starting_at_step={step}, and this run's last step is {steps - 1}"
            elif epoch is not None and epochs is not None and epoch >= epochs:
                late = f"update_starting_at_epoch={epoch}, and its last epoch is {epochs - 1}"
            if late:
                raise ConfigError(
                    f"callbacks.ema.{late}: the average would never be updated, and the "
                    "run would validate, save and test the weights it started from; "
                    "start it earlier (callbacks.ema.update_starting_at_step=1) or leave "
                    "the EMA out (callbacks=default)"
                )

    def on_train_start(self) -> None:
        # The sanity-check validation must not count towards the best accuracy; a resumed
        # run starts from the best of the run it continues.
        self.val_acc_best.reset()
        if self._resumed_val_acc_best is not None:
            self.val_acc_best(torch.tensor(self._resumed_val_acc_best))
        # An epoch shorter than the logging interval (a quick check with
        # limit_train_batches=3) would log no train/loss at all: log every step instead.
        batches = self.trainer.num_training_batches
        if isinstance(batches, int) and 0 < batches < self.trainer.log_every_n_steps:
            self.trainer.log_every_n_steps = 1

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        if self.teacher is None:
            logits = self.step_forward(x)
            loss = self.criterion(logits, y)
        else:  # both heads, on the speed path; the frozen teacher records no graph
            heads = self.step_forward(x, heads=True)
            teacher_logits = self.teacher(x)
            smoothing, tau = self.hparams.label_smoothing, self.hparams.distillation_tau
            loss = distillation_loss(*heads, y, teacher_logits, smoothing, tau)
            logits = average_heads(*heads)
        if not torch.isfinite(loss):
            lr = self.trainer.optimizers[0].param_groups[0]["lr"] if self.trainer else float("nan")
            raise NonFiniteLossError(
                f"training loss is {loss.item()} at step {self.global_step} (epoch "
                f"{self.current_epoch}) with learning rate {lr:.3g}; stopped, and the last "
                "good checkpoint is kept. Lower module.lr or set trainer.gradient_clip_val=1.0"
            )
        # update(), not forward(): the per-batch accuracy would be computed and thrown away.
        self.train_acc.update(logits, y)
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True, prog_bar=True)
        return loss

    def _shift_averaged(
        self, x: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores, logits)`` (B, num_classes) of images ``x`` (B, C, H, W) by ``forward``:
        the logits of ``x`` itself, and the scores judged: the same logits, or with
        ``test_time_shift`` the float32 log of the softmax averaged over 9 shifted copies."""
        logits = forward(x)
        s = self.hparams.test_time_shift
        if not s:
            return logits, logits
        h, w = x.shape[-2:]
        # Repeating the border pixels shifts background in: MNIST-style digits sit inside
        # a blank margin of 4 pixels.
        padded = nn.functional.pad(x, (s, s, s, s), mode="replicate")
        probs = logits.float().softmax(-1)
        for dy in (-s, 0, s):
            for dx in (-s, 0, s):
                if dx or dy:
                    view = padded[..., s + dy : s + dy + h, s + dx : s + dx + w].contiguous()
                    probs = probs + forward(view).float().softmax(-1)
        return (probs / 9).log(), logits

    def _eval_step(self, batch, acc: MulticlassAccuracy, mean_loss: MeanMetric, stage: str):
        x, y = batch
        if stage == "test":
            scores, logits = self._shift_averaged(x, self.step_forward)
            if scores is not logits:
                self.test_acc_one_view(logits, y)
                self.log("test/acc_one_view", self.test_acc_one_view, on_step=False, on_epoch=True)
        else:
            scores = self.step_forward(x)
        # Unsmoothed loss: comparable across label_smoothing settings.
        loss = nn.functional.cross_entropy(scores.float(), y)
        acc(scores, y)
        mean_loss(loss, weight=len(y))
        self.log(f"{stage}/loss", mean_loss, on_step=False, on_epoch=True, prog_bar=stage == "val")
        self.log(f"{stage}/acc", acc, on_step=False, on_epoch=True, prog_bar=True)

    def validation_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, self.val_acc, self.val_loss, "val")

    def on_validation_epoch_end(self) -> None:
        self.val_acc_best(self.val_acc.compute())
        # Already equal on every DDP rank (val_acc.compute() all-reduces); sync_dist says so.
        self.log("val/acc_best", self.val_acc_best.compute(), prog_bar=False, sync_dist=True)

    def test_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, self.test_acc, self.test_loss, "test")

    def predict_step(self, batch, batch_idx: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(images, labels) or images -> (float32 scores (B, num_classes), labels or None):
        the logits, or with ``test_time_shift`` > 0 the log of the shift-averaged softmax."""
        x, y = batch if isinstance(batch, list | tuple) else (batch, None)
        return self._shift_averaged(x, self.net)[0].float(), y

    def configure_optimizers(self):
        hp = self.hparams
        steps = int(self.trainer.estimated_stepping_batches)
        return adamw_warmup_cosine(
            self.net,
            **{k: hp[k] for k in ("lr", "weight_decay", "betas", "warmup_epochs", "min_lr_ratio")},
            schedule_epochs=hp.schedule_epochs,
            total_steps=steps,
            max_epochs=self.trainer.max_epochs,
        )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[RUN_INFO_KEY] = dict(self.run_info)
        best = self.val_acc_best.max_value
        checkpoint["val_acc_best"] = float(best) if torch.isfinite(best) else None
        # Lightning stores no RNG state; with it a resumed run draws the same shuffles
        # and augmentations as an uninterrupted one. Plain tensors and tuples of ints,
        # so the file still loads with weights_only=True.
        checkpoint["rng_states"] = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": random.getstate(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.run_info = dict(checkpoint.get(RUN_INFO_KEY, {}))
        self._resumed_val_acc_best = checkpoint.get("val_acc_best")
        states = checkpoint.get("rng_states")
        if states:
            torch.set_rng_state(states["torch"])
            if states["cuda"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(states["cuda"])
            random.setstate(states["python"])
