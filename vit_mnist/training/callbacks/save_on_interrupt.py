"""Saving ``last.ckpt`` when a run is interrupted, with the command that resumes it."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vit_mnist.training.checkpointing import resume_command

log = logging.getLogger(__name__)


class SaveOnInterrupt(L.Callback):
    """On Ctrl-C (SIGINT) or SIGTERM, save ``last.ckpt`` and print the command that resumes.

    Lightning stops the loop at the next batch boundary and calls ``on_exception``; the
    process then exits non-zero (130 after SIGINT, 143 after SIGTERM, set by
    ``vit_mnist.tasks.train.main``). In the test after training nothing is saved. Other
    exceptions, such as a non-finite loss, save nothing, so the last good checkpoint is kept.

    Nothing is saved before training has started (``on_train_start``, which Lightning calls
    after restoring a resumed checkpoint): until then the weights are the random initial
    ones, and saving them would replace the progress of the run being resumed with a blank
    ``last.ckpt``. The message then repeats the command as it was given.

    Under DDP, SIGTERM is noted by a handler of this callback's and the processes agree on
    it after every training batch (one all-reduce of a flag), so that all of them stop at
    the same batch and save together. Lightning's own handler (lightning 2.6) runs a
    broadcast inside the signal handler; when the signal arrives during the loop's own
    broadcast, the two processes wait on each other for ever (a SIGTERM to the first
    process, or to both, hung a 2-process CPU run with nothing saved).
    """

    def __init__(self) -> None:
        self._training_started = False
        self._sigterm = False
        self._lightning_handler: Any = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._training_started = True
        if trainer.world_size > 1:
            self._sigterm = False
            self._lightning_handler = signal.signal(signal.SIGTERM, self._note_sigterm)

    def _note_sigterm(self, signum: int, frame: Any) -> None:
        self._sigterm = True

    def _any_sigterm(self, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        """Whether a process has had SIGTERM: a collective, which every process calls at the
        same point; False outside DDP."""
        if self._lightning_handler is None:
            return False
        flag = torch.tensor(float(self._sigterm), device=pl_module.device)
        return trainer.strategy.reduce(flag, reduce_op="sum").item() > 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if self._any_sigterm(trainer, pl_module):
            raise SIGTERMException

    def _restore_handler(self) -> None:
        if self._lightning_handler is not None:
            signal.signal(signal.SIGTERM, self._lightning_handler)
            self._lightning_handler = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A SIGTERM after the last batch (in the last validation) still stops the run.
        stop = self._any_sigterm(trainer, pl_module)
        self._restore_handler()
        if stop:
            raise SIGTERMException

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._restore_handler()
        if not isinstance(exception, KeyboardInterrupt | SIGTERMException):
            return
        what = "Interrupted (Ctrl-C)" if isinstance(exception, KeyboardInterrupt) else "SIGTERM"
        stage = trainer.state.fn
        if stage != TrainerFn.FITTING:
            # The test after training: the weights are the best checkpoint's, not the
            # run's last ones, and the checkpoints are already complete.
            log.warning("%s during %s: nothing saved; the checkpoints are whole", what, stage.value)
            return
        if not self._training_started:
            log.warning(
                "%s before training started: nothing saved, no file changed. "
                "Run the same command again:\n  %s",
                what,
                resume_command(None),
            )
            return
        folder = getattr(trainer.checkpoint_callback, "dirpath", None)
        path = Path(folder or Path(trainer.default_root_dir) / "checkpoints") / "last.ckpt"
        # A full checkpoint (optimizer, loops, callbacks) is what resuming needs; saying so
        # also spares Lightning's note that weights_only defaulted to False.
        trainer.save_checkpoint(path, weights_only=False)
        message = (
            f"{what} at epoch {trainer.current_epoch}, step {trainer.global_step}: saved {path}\n"
            f"Resume with:\n  {resume_command(path)}"
        )
        # Through logging: the console and the run's log file both get it, once (from the
        # first process: the others' command lines are Lightning's, not the user's).
        if trainer.is_global_zero:
            log.warning(message)
