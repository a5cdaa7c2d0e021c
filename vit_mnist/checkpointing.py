"""Checkpoints that survive kills: atomic writes, saving on interrupt, finding the latest."""

from __future__ import annotations

import io
import logging
import shlex
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vit_mnist.data.sources import atomic_write_bytes
from vit_mnist.errors import CheckpointError

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary file in the same folder, fsyncs it, and
    renames it into place, so a process killed mid-write leaves the previous file intact.

    (Lightning's own writer goes through an fsspec transaction whose temporary file may
    sit on another filesystem, where the final move is a copy that a kill can cut short.)
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        atomic_write_bytes(Path(path), buffer.getvalue())


def find_latest(log_dir: str | Path, pattern: str) -> Path | None:
    """The most recently modified file matching ``pattern`` anywhere under ``log_dir``."""
    found = [p for p in Path(log_dir).rglob(pattern) if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def resolve_latest(value: str | Path, log_dir: str | Path, pattern: str) -> Path:
    """``value`` as a path, or for ``"latest"`` the newest ``pattern`` under ``log_dir``.

    Raises:
        CheckpointError: ``latest`` was asked for and nothing matches.
    """
    if str(value) != "latest":
        return Path(value)
    latest = find_latest(log_dir, pattern)
    if latest is None:
        raise CheckpointError(
            f"ckpt_path=latest: no {pattern} under {log_dir}; train first or give a path"
        )
    log.info("ckpt_path=latest -> %s", latest)
    return latest


def resume_command(ckpt: Path) -> str:
    """The command line that resumes this run from ``ckpt``: same overrides, new ckpt_path."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("ckpt_path=")]
    except ValueError:  # not started by @hydra.main (tests, notebooks)
        overrides = []
    return shlex.join(["python", "train.py", *overrides, f"ckpt_path={ckpt}"])


class SaveOnInterrupt(L.Callback):
    """On Ctrl-C (SIGINT) or SIGTERM, save ``last.ckpt`` and print the command that resumes.

    Lightning stops the loop at the next batch boundary and calls ``on_exception``; the
    process then exits non-zero (1 after SIGINT; 143 after SIGTERM, set by
    ``vit_mnist.train.main``). Other exceptions, such as a non-finite loss, save nothing,
    so the last good checkpoint is kept.
    """

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if not isinstance(exception, KeyboardInterrupt | SIGTERMException):
            return
        callback = trainer.checkpoint_callback
        folder = Path(callback.dirpath) if isinstance(callback, ModelCheckpoint) else None
        if folder is None:
            folder = Path(trainer.default_root_dir) / "checkpoints"
        path = folder / "last.ckpt"
        trainer.save_checkpoint(path)
        what = "Interrupted (Ctrl-C)" if isinstance(exception, KeyboardInterrupt) else "SIGTERM"
        message = (
            f"{what} at epoch {trainer.current_epoch}, step {trainer.global_step}: saved {path}\n"
            f"Resume with:\n  {resume_command(path)}"
        )
        # Through logging: the console and the run's log file both get it, once.
        log.warning(message)
