"""Images per second of the training loop, with validation and its callbacks left out."""

from __future__ import annotations

import statistics
import time

import lightning as L


class TrainThroughput(L.Callback):
    """Measures the training loop's throughput, in images/s, epoch by epoch.

    An epoch's clock runs from ``on_train_epoch_start`` until its validation starts (or
    the epoch ends when there is none), so it covers fetching batches, forward, backward
    and optimizer steps, and leaves out validation and whatever callbacks do after it.

    Attributes:
        images_per_s: one figure per finished training epoch.
    """

    def __init__(self) -> None:
        self.images_per_s: list[float] = []
        self._start: float | None = None
        self._images = 0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start, self._images = time.perf_counter(), 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._images += len(batch[0])

    def _stop(self) -> None:
        if self._start is not None and self._images:
            self.images_per_s.append(self._images / (time.perf_counter() - self._start))
        self._start = None

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._stop()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop()

    @property
    def median(self) -> float | None:
        """Median images/s over the epochs measured, or None before the first."""
        return statistics.median(self.images_per_s) if self.images_per_s else None
