"""Images per second of the training loop, with validation and its callbacks left out."""

from __future__ import annotations

import statistics
import time

import lightning as L
import torch


class TrainThroughput(L.Callback):
    """Measures the training loop's throughput, in images/s, epoch by epoch, and the
    fitting time.

    An epoch's clock runs from ``on_train_epoch_start`` until its validation starts (or
    the epoch ends when there is none), so it covers fetching batches, forward, backward
    and optimizer steps, and leaves out validation and whatever callbacks do after it.

    Attributes:
        images_per_s: one figure per finished training epoch.
        fit_time_s: wall seconds from the start of the first training step to the end of
            the last one (CUDA synchronised), with the validations in between; it leaves
            out process start, data preparation, the sanity check and the final test.
            A resumed run adds the seconds its checkpoint carries (:meth:`state_dict`),
            so a run stopped and resumed counts every stretch of its fitting. None before
            a training step has finished, or when the run resumed from a checkpoint that
            does not carry them (written before they were carried).
        first_step_s: wall seconds of the first training step (a compiled speed path
            compiles in it), None before it has finished.
    """

    def __init__(self) -> None:
        self.images_per_s: list[float] = []
        self.first_step_s: float | None = None
        self._images = 0
        self._start = self._first_step = self._last_step_end = None  # perf_counter() seconds
        # Fitting seconds of the stretches before a resume: 0 for a fresh run, None when a
        # checkpoint was resumed that did not carry them.
        self._earlier_s: float | None = 0.0
        self._carried: dict | None = None  # this callback's state in the checkpoint loaded

    def state_dict(self) -> dict[str, float | list[float] | None]:
        """What a checkpoint carries to a resumed run: the fitting seconds so far (up to
        this moment: a checkpoint written on Ctrl-C or SIGTERM mid-epoch counts that
        epoch's part) and the images/s of the finished epochs."""
        so_far = self._earlier_s
        if self._first_step is not None and so_far is not None:
            so_far += time.perf_counter() - self._first_step
        return {"fit_time_s": so_far, "images_per_s": list(self.images_per_s)}

    def load_state_dict(self, state_dict: dict) -> None:
        # Lightning also loads it for the test of the best checkpoint after fitting: only
        # a resumed fit reads it (on_train_start).
        self._carried = dict(state_dict)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.ckpt_path:
            return
        carried = self._carried or {}
        # None: resumed from a checkpoint written before the time was carried.
        self._earlier_s = carried.get("fit_time_s") if self._carried is not None else None
        self.images_per_s = list(carried.get("images_per_s") or [])

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start, self._images = time.perf_counter(), 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self._first_step is None:
            self._sync(pl_module)
            self._first_step = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._images += len(batch[0])
        if self.first_step_s is None:
            self._sync(pl_module)
            self.first_step_s = time.perf_counter() - self._first_step

    @staticmethod
    def _sync(pl_module: L.LightningModule) -> None:
        # CUDA runs ahead of Python: wait for the queued steps before reading the clock.
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def _stop(self, pl_module: L.LightningModule) -> None:
        self._sync(pl_module)
        now = time.perf_counter()
        if self._start is not None and self._images:
            self.images_per_s.append(self._images / (now - self._start))
            self._last_step_end = now
        self._start = None

    @property
    def fit_time_s(self) -> float | None:
        if self._first_step is None or self._last_step_end is None or self._earlier_s is None:
            return None
        return self._earlier_s + self._last_step_end - self._first_step

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._stop(pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop(pl_module)

    def metrics(self, world_size: int = 1) -> dict[str, float | list[float] | None]:
        """This callback's keys of ``metrics.json``, for ``world_size`` processes kept in
        step (DDP: rank 0's rate times the world size):

        - ``train_images_per_s``: the median over epochs of the training loop's images/s;
        - ``train_images_per_s_by_epoch``: the same, epoch by epoch (on a shared machine
          the rate can change from one epoch to the next, which the median hides), the
          epochs before a resume included;
        - ``fit_time_s``: see :attr:`fit_time_s` (the speedrun's clock);
        - ``fit_time_resumed_s``: the part of it that the resumed checkpoint carried (0 for
          a run that was not resumed, None when its checkpoint carried none);
        - ``first_step_s``: see :attr:`first_step_s`.
        """
        median = statistics.median(self.images_per_s) if self.images_per_s else None
        return {
            "train_images_per_s": round(median * world_size, 1) if median else None,
            "train_images_per_s_by_epoch": [round(r * world_size, 1) for r in self.images_per_s],
            "fit_time_s": round(self.fit_time_s, 2) if self.fit_time_s else None,
            "fit_time_resumed_s": None if self._earlier_s is None else round(self._earlier_s, 2),
            "first_step_s": round(self.first_step_s, 2) if self.first_step_s else None,
        }
