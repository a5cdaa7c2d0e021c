"""Saving ``last.ckpt`` when a run is interrupted, with the command that resumes it."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vit_mnist.checkpointing import resume_command

log = logging.getLogger(__name__)


class SaveOnInterrupt(L.Callback):
    """On Ctrl-C (SIGINT) or SIGTERM, save ``last.ckpt`` and print the command that resumes.

    Lightning stops the loop at the next batch boundary and calls ``on_exception``; the
    process then exits non-zero (130 after SIGINT, 143 after SIGTERM, set by
    ``vit_mnist.train.main``). In the test after training nothing is saved. Other
    exceptions, such as a non-finite loss, save nothing, so the last good checkpoint is kept.

    Nothing is saved before training has started (``on_train_start``, which Lightning calls
    after restoring a resumed checkpoint): until then the weights are the random initial
    ones, and saving them would replace the progress of the run being resumed with a blank
    ``last.ckpt``. The message then repeats the command as it was given.
    """

    def __init__(self) -> None:
        self._training_started = False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._training_started = True

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
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
        callback = trainer.checkpoint_callback
        folder = Path(callback.dirpath) if isinstance(callback, ModelCheckpoint) else None
        if folder is None:
            folder = Path(trainer.default_root_dir) / "checkpoints"
        path = folder / "last.ckpt"
        # A full checkpoint (optimizer, loops, callbacks) is what resuming needs; saying so
        # also spares Lightning's note that weights_only defaulted to False.
        trainer.save_checkpoint(path, weights_only=False)
        message = (
            f"{what} at epoch {trainer.current_epoch}, step {trainer.global_step}: saved {path}\n"
            f"Resume with:\n  {resume_command(path)}"
        )
        # Through logging: the console and the run's log file both get it, once.
        log.warning(message)
