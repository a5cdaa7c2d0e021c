"""Test-only pieces that configs can name by ``_target_``."""

from __future__ import annotations

import lightning as L


class PoisonBatch(L.Callback):
    """Turns the training batch at ``at_step`` into NaNs, to provoke a non-finite loss."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.at_step:
            batch[0].fill_(float("nan"))
