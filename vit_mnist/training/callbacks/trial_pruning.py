"""Optuna's pruning inside a study's trial: the study's pruner stops a training run whose
validation trails the other trials' at the same epoch (``hydra.sweeper.pruner``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L

from vit_mnist.errors import ConfigError

_trial: Any = None  # the Optuna trial of the job running in this process


@contextmanager
def running_trial(trial: Any) -> Iterator[None]:
    """Make ``trial`` (an ``optuna.trial.Trial``) the one :class:`TrialPruning` reports to,
    while the study sweeper runs its job in this process."""
    global _trial
    _trial = trial
    try:
        yield
    finally:
        _trial = None


class TrialPruning(L.Callback):
    """After every validation, report ``monitor`` to the study's trial, with the epoch as
    the step, and stop the fit at the end of that epoch when the study's pruner says so
    (``Trial.should_prune``: Optuna's median pruner, Hyperband, ...). The study sweeper
    adds it to each trial's run when it has a pruner, and tells a trial it stopped as
    ``PRUNED``.

    Optuna 2.10's ``PyTorchLightningPruningCallback`` (the version hydra-optuna-sweeper
    pins) is a ``pytorch_lightning`` callback, which ``lightning``'s Trainer refuses, and it
    ends a pruned trial by raising through ``fit``, which would record the run as failed.

    Args:
        monitor: a metric logged at validation, e.g. ``val/acc_best``.

    Raises:
        ConfigError: no study trial is running in this process (the callback is the study
            sweeper's; a run of its own has nothing to report to).
    """

    def __init__(self, monitor: str) -> None:
        if _trial is None:
            raise ConfigError(
                "callbacks.trial_pruning reports to a study's trial and no study is running "
                "here; remove it (~callbacks.trial_pruning) or set a pruner on the study "
                "(hydra.sweeper.pruner, configs/hparams_search/mnist_optuna.yaml)"
            )
        self.trial = _trial
        self.monitor = monitor

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or self.monitor not in trainer.callback_metrics:
            return
        self.trial.report(float(trainer.callback_metrics[self.monitor]), step=trainer.current_epoch)
        if self.trial.should_prune():
            trainer.should_stop = True
