"""``train(cfg)``: config -> datamodule + model -> Lightning trainer -> checkpoints and metrics."""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from vit_mnist.errors import ConfigError, WriteError, exit_on_user_error
from vit_mnist.hardware import describe_device, resolve_accelerator, uses_cuda
from vit_mnist.io import write_metrics
from vit_mnist.speed.choose import Choice, note_loop_speed, prepare_speed
from vit_mnist.training.callbacks.throughput import TrainThroughput
from vit_mnist.training.checkpointing import (
    model_to_start_from,
    resume_checkpoint,
    resume_command,
)
from vit_mnist.training.checks import check_run, resolved
from vit_mnist.training.module import ViTClassifier

log = logging.getLogger(__name__)


def _experiment_name() -> str | None:
    """The ``experiment=NAME`` of this run (None without one, or outside ``@hydra.main``)."""
    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.choices.get("experiment")


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train, then test the best checkpoint; write ``metrics.json`` into the run dir.

    Args:
        cfg: the composed ``configs/train.yaml``.

    Returns:
        The metrics written to ``<paths.output_dir>/metrics.json``: ``test/acc``,
        ``test/loss``, ``val/acc_best`` (fractions), ``num_params``, ``train_time_s``
        (wall seconds of ``trainer.fit``), ``device``, ``data_source`` and more
        (:func:`_run_metrics`). Under DDP the metrics are all-reduced over the processes,
        and only rank 0 writes the file.

    Raises:
        ConfigError: an impossible setting (checked before data or model are built).
        DataError: data files that cannot be found, fetched or verified.
    """
    start = model_to_start_from(cfg)
    model = start.model if start else resolved(cfg.model)
    # What the student learns from, for metrics.json and its checkpoints.
    teacher = check_run(cfg, model)
    # The config stays what the user composed (and .hydra/config.yaml records): what
    # init_from and a resume decide is in `start` and `resume`.
    OmegaConf.set_readonly(cfg, True)
    resume = resume_checkpoint(cfg)
    ckpt_path, start_step = resume.path, resume.start_step
    L.seed_everything(cfg.seed, workers=True)

    log.info("Building datamodule <%s>", cfg.data._target_)
    datamodule: L.LightningDataModule = hydra.utils.instantiate(cfg.data)
    if hasattr(datamodule, "check_batch_size"):
        datamodule.check_batch_size()  # before the speed paths are timed on such batches
    log.info("Building model: %s", model)
    # _convert_="all": plain dicts and lists, so checkpoints load with weights_only=True.
    module: ViTClassifier = hydra.utils.instantiate(
        cfg.module, model=model, **resume.module, _convert_="all"
    )
    if start is not None:
        module.net.load_state_dict(start.weights)
    choice = prepare_speed(module, cfg, datamodule, start_step)
    module.run_info = {"data": resolved(cfg.data), "precision": choice.precision, "seed": cfg.seed}
    if start is not None and start.pruned_from:
        module.run_info["pruned_from"] = start.pruned_from  # a fine-tuned pruned model still is one
    if teacher is not None:
        module.run_info["teacher"] = teacher

    trainer = _build_trainer(cfg, choice)
    num_params = sum(p.numel() for p in module.net.parameters())
    for lg in trainer.loggers:
        lg.log_hyperparams(
            {"num_params": num_params, "seed": cfg.seed, "batch_size": cfg.data.batch_size}
        )

    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    train_time_s = time.perf_counter() - start
    _check_trained(cfg, trainer, start_step, ckpt_path)
    fit_metrics = {
        k: v for k, v in trainer.callback_metrics.items() if k.startswith(("train/", "val/"))
    }

    best_ckpt, test_metrics = _test_best(cfg, trainer, module, datamodule)
    run_metrics = _run_metrics(cfg, trainer, datamodule, choice)
    if trainer.is_global_zero:  # the guard against a lucky timing: the loop against the step
        note_loop_speed(choice, run_metrics.get("train_images_per_s"), trainer.world_size)
    metrics = {
        **fit_metrics,
        **test_metrics,
        "num_params": num_params,
        "train_time_s": round(train_time_s, 2),
        "model": model,  # what trained: init_from's, else the config's
        **run_metrics,
        "best_ckpt": best_ckpt or None,
        "resumed_from": str(ckpt_path) if ckpt_path else None,
        "teacher": teacher,
    }
    if not trainer.is_global_zero:
        # Under DDP every process has the same all-reduced metrics; one writes the file.
        return metrics
    return write_metrics(Path(cfg.paths.output_dir) / "metrics.json", metrics)


def _build_trainer(cfg: DictConfig, choice: Choice) -> L.Trainer:
    """The configured Trainer with its callbacks and loggers, on the device and at the
    precision the speed paths were timed with (``choice``)."""
    # `callbacks.NAME=null` on the command line switches one off (configs/callbacks/).
    callbacks = [hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c]
    loggers = [hydra.utils.instantiate(c) for c in (cfg.get("logger") or {}).values() if c]
    on = dict(accelerator=resolve_accelerator(cfg.trainer.accelerator), precision=choice.precision)
    return hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers, **on)


def _test_best(
    cfg: DictConfig, trainer: L.Trainer, module: ViTClassifier, datamodule: L.LightningDataModule
) -> tuple[str, dict[str, Any]]:
    """The best checkpoint's path ("" where none was kept), logged beside the run's scalars,
    and with ``cfg.test`` its ``test/`` metrics ({} without)."""
    best_ckpt = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    for lg in trainer.loggers:
        lg.log_hyperparams({"best_ckpt": best_ckpt or "none"})
    if not cfg.get("test"):
        return best_ckpt, {}
    # The best checkpoint by val/acc; the current weights when no checkpoint was kept.
    trainer.test(module, datamodule=datamodule, ckpt_path=best_ckpt or None)
    return best_ckpt, {k: v for k, v in trainer.callback_metrics.items() if k.startswith("test/")}


def _check_trained(cfg: DictConfig, trainer: L.Trainer, start_step: int, ckpt_path) -> None:
    """Raise ConfigError where no training step ran: metrics.json would describe a run
    that did not happen."""
    if trainer.global_step > start_step or trainer.interrupted:
        return
    if ckpt_path:
        why = (
            f", as in {ckpt_path}): the checkpoint already reached "
            f"trainer.max_epochs={cfg.trainer.max_epochs}; raise it to train on"
        )
    else:
        why = (
            f"): trainer.limit_train_batches={cfg.trainer.get('limit_train_batches')} "
            "or the data leave no batch to train on"
        )
    raise ConfigError(f"no training step ran (global step {trainer.global_step}{why}")


def _run_metrics(
    cfg: DictConfig, trainer: L.Trainer, datamodule: L.LightningDataModule, choice: Choice
) -> dict[str, Any]:
    """What the run was and how fast it went, from the objects that know: the speed
    layer's choice (:meth:`Choice.metrics`), the throughput callback
    (:meth:`TrainThroughput.metrics`), the trainer and the datamodule."""
    throughput = next((c for c in trainer.callbacks if isinstance(c, TrainThroughput)), None)
    return {
        **choice.metrics(),
        **(throughput.metrics(trainer.world_size) if throughput else {}),
        "world_size": trainer.world_size,
        "effective_batch_size": cfg.data.batch_size * trainer.world_size,
        "epochs": trainer.current_epoch,
        "global_steps": trainer.global_step,
        "device": describe_device(trainer.strategy.root_device, trainer.world_size),
        "precision": str(trainer.precision),
        "dataset": getattr(datamodule, "name", type(datamodule).__name__),
        "experiment": _experiment_name(),
        "data_source": getattr(datamodule, "source", None),
        "seed": cfg.seed,
        "init_from": cfg.get("init_from"),
    }


STOPPED = "Stopped by %s outside the training loop; every file written so far is complete."


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM outside Lightning's loops (data preparation, the speed timing, between fit
    and test): stop at once. Inside them Lightning's handler runs and calls this one too;
    there the loop stops at the next batch and the callbacks say what they saved, except
    in a compile (the ``compile`` paths' first step, 30-60 s), which stops at once: no
    weight has changed during it."""
    if signal.getsignal(signal.SIGTERM) is _stop_on_sigterm:
        log.warning(STOPPED, "SIGTERM")
        raise SIGTERMException
    while frame is not None:
        if "/torch/_dynamo/" in frame.f_code.co_filename:
            raise SIGTERMException
        frame = frame.f_back


# A full disk, a quota, a read-only or forbidden folder: what a writer cannot do.
WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def _quiet_write_errors(hook: Callable[[Any], None]) -> Callable[[Any], None]:
    """``threading.excepthook`` without the traceback of a writer thread's failed write:
    TensorBoard's event writer raises it again in the main thread at its next write, where
    :func:`main` says it in one line."""

    def quiet(args: Any) -> None:
        if isinstance(args.exc_value, OSError) and args.exc_value.errno in WRITE_ERRNOS:
            log.debug("write error in thread %s", args.thread, exc_info=args.exc_value)
            return
        hook(args)

    return quiet


# The environment this process started with: a DDP job inside a multirun puts it back.
_ENV_AT_START = dict(os.environ)


def prepare_ddp_launch(trainer_cfg: DictConfig) -> None:
    """Prepare a DDP run: on a CPU, each process's share of the cores, which Lightning sets
    when fit starts (unless ``OMP_NUM_THREADS`` does), is set now, so that the speed paths
    are timed as they will run; and Lightning's DDP starts its extra processes as this one
    job, not as the sweep.

    Lightning starts DDP's extra processes by running ``sys.argv`` again in
    ``HydraConfig.run.dir``; inside a local multirun (``-m``) that command line is the whole
    sweep and that folder is not the job's. So the command line becomes this job's own
    overrides with ``hydra.mode=RUN``, and ``run.dir`` this job's run dir. Under SLURM
    (submitit) or torchrun the processes are started outside, one per task, and nothing is
    re-run.
    """
    from hydra.types import RunMode
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
    from omegaconf import open_dict, read_write

    if not str(trainer_cfg.get("strategy", "auto")).startswith("ddp"):
        return
    processes = trainer_cfg.get("devices")
    on_cpu = not uses_cuda(str(trainer_cfg.get("accelerator"))) and isinstance(processes, int)
    if on_cpu and processes > 1 and "OMP_NUM_THREADS" not in os.environ:
        affinity = getattr(os, "sched_getaffinity", None)  # not on macOS
        cores = len(affinity(0)) if affinity else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // processes))
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    if SLURMEnvironment.detect() or TorchElasticEnvironment.detect():
        return
    # The job before this one left its process group and Lightning's rank variables behind;
    # with LOCAL_RANK set, Lightning would take this process for a child and start none.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for key in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE"):
        if key in _ENV_AT_START:
            os.environ[key] = _ENV_AT_START[key]
        else:
            os.environ.pop(key, None)
    hydra_cfg = HydraConfig.get()
    sys.argv = [sys.argv[0], *hydra_cfg.overrides.task, "hydra.mode=RUN"]
    with read_write(hydra_cfg), open_dict(hydra_cfg):
        hydra_cfg.run.dir = hydra_cfg.runtime.output_dir


@exit_on_user_error
def main(cfg: DictConfig) -> dict[str, Any]:
    """The body of ``python train.py``: ``train(cfg)``, bad input reported in one line.

    Exit status: 0 when done, 2 for bad input, a non-finite loss or files that cannot be
    written (a full disk, a folder made read-only: one line, what was written kept), 130
    after Ctrl-C and 143 after SIGTERM. In the training loop both save ``last.ckpt`` first
    and print the command that resumes (:class:`~vit_mnist.training.callbacks.SaveOnInterrupt`);
    anywhere else they stop at once with one line.
    """
    prepare_ddp_launch(cfg.trainer)
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    previous_hook = threading.excepthook
    threading.excepthook = _quiet_write_errors(previous_hook)
    try:
        return train(cfg)
    except OSError as e:
        if isinstance(e, WriteError) or e.errno not in WRITE_ERRNOS:
            raise
        # A logger's writes (TensorBoard's in a thread of its own, the CSV logger's) failed:
        # the disk filled, or the folder became read-only. Each file already written is whole.
        last = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
        then = f"resume: {resume_command(last)}" if last.is_file() else "run the command again"
        raise WriteError(
            f"cannot write the run's files in {cfg.paths.output_dir}: {e.strerror or e}; "
            f"what was written before is kept. Make room, then {then}"
        ) from None
    except KeyboardInterrupt:
        # Outside Lightning's loops: inside them Lightning exits with 1 instead (below).
        log.warning(STOPPED, "Ctrl-C")
        raise SystemExit(128 + signal.SIGINT) from None
    except SIGTERMException:
        # Lightning's SIGTERMException is a SystemExit with status 0: make it a failure.
        raise SystemExit(128 + signal.SIGTERM) from None
    except SystemExit as e:
        # Lightning's exit after Ctrl-C in a loop: sys.exit(1) while handling the interrupt.
        if e.code == 1 and isinstance(e.__context__, KeyboardInterrupt):
            raise SystemExit(128 + signal.SIGINT) from None
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        threading.excepthook = previous_hook
