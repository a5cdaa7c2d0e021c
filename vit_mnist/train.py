"""``train(cfg)``: config -> datamodule + model -> Lightning trainer -> checkpoints and metrics."""

from __future__ import annotations

import inspect
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict, read_write

from vit_mnist.callbacks.throughput import TrainThroughput
from vit_mnist.checkpointing import (
    model_differences,
    read_checkpoint,
    resolve_latest,
)
from vit_mnist.data.augment import BatchAugment
from vit_mnist.data.sources import MNIST_MD5, raw_folder
from vit_mnist.errors import ConfigError, exit_on_user_error
from vit_mnist.io import write_metrics
from vit_mnist.models.vit import check_vit_args
from vit_mnist.module import ViTClassifier
from vit_mnist.settings import PRECISIONS, TrainSettings, check_settings, import_target
from vit_mnist.speed.choose import check_speed_path, choose
from vit_mnist.speed.hardware import describe_device, resolve_precision, uses_cuda

log = logging.getLogger(__name__)


def _resolved(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if node is not None else None


def _check_device(trainer_cfg: DictConfig) -> None:
    """The accelerator, precision and device count against this machine (each value's
    range is the schema's)."""
    accelerator = str(trainer_cfg.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.accelerator={accelerator} but this machine has no CUDA device; "
            "use trainer=cpu or trainer=default (accelerator: auto)"
        )
    on_cuda = uses_cuda(accelerator)
    precision = resolve_precision(trainer_cfg.get("precision", "auto"), on_cuda)
    # float16 is a GPU format: Lightning's CPU accelerator refuses it.
    valid = [p for p in PRECISIONS if on_cuda or not p.startswith("16")]
    if precision not in valid:
        raise ConfigError(
            f"trainer.precision={precision} cannot run on {'cuda' if on_cuda else 'cpu'}; "
            f"use one of {['auto', *valid]}"
        )
    if on_cuda and precision.startswith("bf16") and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"trainer.precision={precision}: this GPU has no bfloat16; use 16-mixed or 32-true"
        )
    devices = trainer_cfg.get("devices", 1)
    if on_cuda and isinstance(devices, int) and devices > torch.cuda.device_count():
        raise ConfigError(
            f"trainer.devices={devices} but this machine has {torch.cuda.device_count()} "
            "CUDA device(s); use trainer.devices=auto or a smaller number"
        )


_ENV_AT_IMPORT = dict(os.environ)


def _planned_steps(
    trainer_cfg: DictConfig, train_size: int | None, batch_size: int, start_step: int
) -> int | None:
    """About how many training steps each process of this run will take (the compile
    budget of ``speed.auto_compile=auto`` is a share of the training time), or None where
    the data cannot say before they are read."""
    max_steps = int(trainer_cfg.get("max_steps") or -1)
    if train_size is None:
        return max_steps - start_step if max_steps > 0 else None
    devices = trainer_cfg.get("devices", 1)
    processes = len(devices) if isinstance(devices, (list, ListConfig)) else devices
    if not isinstance(processes, int) or not str(trainer_cfg.get("strategy", "")).startswith("ddp"):
        processes = 1
    per_epoch = math.ceil(train_size / (batch_size * processes))
    limit = trainer_cfg.get("limit_train_batches", 1.0)
    if isinstance(limit, float):
        per_epoch = int(per_epoch * limit)
    elif isinstance(limit, int):
        per_epoch = min(per_epoch, limit)
    steps = per_epoch * int(trainer_cfg.get("max_epochs") or 1)
    if max_steps > 0:
        steps = min(steps, max_steps)
    return max(steps - start_step, 0)


def _prepare_ddp_launch(trainer_cfg: DictConfig) -> None:
    """Let Lightning's DDP start its extra processes as this one job, not as the sweep.

    Lightning starts DDP's extra processes by running ``sys.argv`` again in
    ``HydraConfig.run.dir``; inside a local multirun (``-m``) that command line is the whole
    sweep and that folder is not the job's. So the command line becomes this job's own
    overrides with ``hydra.mode=RUN``, and ``run.dir`` this job's run dir. Under SLURM
    (submitit) or torchrun the processes are started outside, one per task, and nothing is
    re-run.
    """
    if not str(trainer_cfg.get("strategy", "auto")).startswith("ddp"):
        return
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    if SLURMEnvironment.detect() or TorchElasticEnvironment.detect():
        return
    # The job before this one left its process group and Lightning's rank variables behind;
    # with LOCAL_RANK set, Lightning would take this process for a child and start none.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for key in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE"):
        if key in _ENV_AT_IMPORT:
            os.environ[key] = _ENV_AT_IMPORT[key]
        else:
            os.environ.pop(key, None)
    hydra_cfg = HydraConfig.get()
    sys.argv = [sys.argv[0], *hydra_cfg.overrides.task, "hydra.mode=RUN"]
    with read_write(hydra_cfg), open_dict(hydra_cfg):
        hydra_cfg.run.dir = hydra_cfg.runtime.output_dir


def _check_data_dir(data_dir: str, folder: str = "MNIST") -> None:
    # MNIST and Fashion-MNIST use the same four file names, in <data_dir>/<folder>/raw.
    if all((raw_folder(data_dir, folder) / name).is_file() for name in MNIST_MD5):
        return  # complete already: read-only is fine
    existing = Path(data_dir).resolve()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"data.data_dir={data_dir} cannot be written ({existing} is not a writable "
            f"folder) and holds no {folder} yet; choose a writable folder with paths.data_dir=PATH"
        )


def _check_model_fits_data(model: dict[str, Any], datamodule_cls: type) -> None:
    """The model's classes, channels and image size are the dataset's."""
    name = getattr(datamodule_cls, "name", datamodule_cls.__name__)
    channels, height, width = getattr(datamodule_cls, "image_shape", (None, None, None))
    wanted = {
        "num_classes": getattr(datamodule_cls, "num_classes", None),
        "in_chans": channels,
        "img_size": height if height == width else None,
    }
    for key, value in wanted.items():
        if value is not None and key in model and model[key] != value:
            raise ConfigError(
                f"model.{key}={model[key]} does not fit the data: {name} has {value} "
                f"({key}); set model.{key}={value} or choose another data="
            )


def check_config(cfg: DictConfig) -> None:
    """Fail fast, before any data is read or a model is built, on settings that cannot work.

    Every key's type and range against the schema (vit_mnist/settings.py), then what needs
    more than one value or the machine: the model's shape, the model against the dataset,
    the augmentation's ranges together, the device and its precision, and that the data
    directory can be written when the data must be fetched into it.

    Raises:
        ConfigError: one line naming the key, the value and what would be valid.
    """
    # Every key's type and range (seed_everything would truncate seed=1.5 to 1 while
    # metrics.json recorded 1.5); what follows checks values against each other.
    check_settings(cfg, TrainSettings)
    model = _resolved(cfg.model)
    check_vit_args(**model)
    check_speed_path((cfg.get("speed") or {}).get("path", "auto"))
    data = cfg.data
    if data.get("augment"):
        # Its ranges together (scale as [min, max], min <= max), which no one field states.
        BatchAugment(**_resolved(data.augment))
    # check_settings has imported data._target_ already; only "is it a class" is new here.
    datamodule_cls = import_target(data._target_)
    if not inspect.isclass(datamodule_cls):
        raise ConfigError(
            f"data._target_={data._target_} is not a class; "
            "use data=mnist, data=fashion_mnist or data=synthetic"
        )
    _check_model_fits_data(model, datamodule_cls)
    if data.get("data_dir") is not None:
        _check_data_dir(str(data.data_dir), getattr(datamodule_cls, "folder", "MNIST"))
    _check_device(cfg.trainer)


def _model_to_start_from(cfg: DictConfig) -> dict[str, torch.Tensor] | None:
    """For ``init_from=PATH``: put that checkpoint's model arguments into ``cfg.model`` and
    return its network weights; None without ``init_from``.

    Raises:
        ConfigError: ``init_from`` together with ``ckpt_path``.
        CheckpointError: see :func:`vit_mnist.checkpointing.read_checkpoint`.
    """
    path = cfg.get("init_from")
    if path is None:
        return None
    if cfg.get("ckpt_path") is not None:
        raise ConfigError(
            f"init_from={path} and ckpt_path={cfg.ckpt_path}: give one; ckpt_path resumes a "
            "run where it stopped, init_from starts a new one from a checkpoint's model"
        )
    ckpt = read_checkpoint(path)
    with open_dict(cfg):
        cfg.model = OmegaConf.create(ckpt["hyper_parameters"]["model"])
    log.info("init_from=%s: model %s, training from epoch 0", path, _resolved(cfg.model))
    prefix = "net."
    return {k[len(prefix) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}


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
        (wall seconds of ``trainer.fit``), ``device``, ``data_source`` and more. Under DDP
        the metrics are all-reduced over the processes, and only rank 0 writes the file.

    Raises:
        ConfigError: an impossible setting (checked before data or model are built).
        DataError: data files that cannot be found, fetched or verified.
    """
    init = _model_to_start_from(cfg)
    check_config(cfg)
    ckpt_path = cfg.get("ckpt_path")
    start_step = 0
    if ckpt_path is not None:
        model_args = _resolved(cfg.model)
        ckpt_path = resolve_latest(ckpt_path, cfg.paths.log_dir, "last.ckpt", model_args)
        ckpt = read_checkpoint(ckpt_path)  # a clear error for a missing or foreign file
        differences = model_differences(ckpt["hyper_parameters"]["model"], model_args)
        if differences:
            raise ConfigError(
                f"ckpt_path={ckpt_path} was trained with another model: "
                f"{'; '.join(differences)}. Resume it with its own model settings, or leave "
                "ckpt_path out to start a new run"
            )
        start_step = int(ckpt.get("global_step", 0))
    L.seed_everything(cfg.seed, workers=True)
    output_dir = Path(cfg.paths.output_dir)

    log.info("Building datamodule <%s>", cfg.data._target_)
    datamodule: L.LightningDataModule = hydra.utils.instantiate(cfg.data)
    if hasattr(datamodule, "check_batch_size"):
        # Before the speed paths are timed on batches of this size.
        datamodule.check_batch_size()
    log.info("Building model: %s", _resolved(cfg.model))
    # _convert_="all": plain dicts and lists, so checkpoints load with weights_only=True.
    module: ViTClassifier = hydra.utils.instantiate(
        cfg.module, model=_resolved(cfg.model), _convert_="all"
    )
    if init is not None:
        module.net.load_state_dict(init)
    speed = cfg.get("speed") or {}
    device = torch.device("cuda" if uses_cuda(str(cfg.trainer.get("accelerator"))) else "cpu")
    choice = choose(
        module.net,
        model_args=_resolved(cfg.model),
        device=device,
        batch_size=cfg.data.batch_size,
        path=speed.get("path", "auto"),
        precision=str(cfg.trainer.get("precision", "auto")),
        include_compiled=speed.get("auto_compile", "auto"),
        compile_budget=float(speed.get("compile_budget", 0.05)),
        planned_steps=_planned_steps(
            cfg.trainer, getattr(datamodule, "train_size", None), cfg.data.batch_size, start_step
        ),
        use_cache=bool(speed.get("cache", True)),
        # DDP's processes train side by side: the run's seconds count once.
        count_training=rank_zero_only.rank == 0,
        allocator=speed.get("allocator", "auto"),
    )
    module.use_speed_path(choice.path)
    module.record_compiles = bool(speed.get("cache", True))
    precision = choice.precision
    log.info(choice.describe(device))
    module.run_info = {
        "data": _resolved(cfg.data),
        "precision": precision,
        "seed": cfg.seed,
    }
    # `callbacks.NAME=null` on the command line switches one off (configs/callbacks/).
    callbacks = [
        hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None
    ]
    throughput = next((c for c in callbacks if isinstance(c, TrainThroughput)), None)
    loggers = [
        hydra.utils.instantiate(c) for c in (cfg.get("logger") or {}).values() if c is not None
    ]
    _prepare_ddp_launch(cfg.trainer)
    trainer: L.Trainer = hydra.utils.instantiate(
        cfg.trainer,
        callbacks=callbacks,
        logger=loggers,
        precision=precision,
    )

    num_params = sum(p.numel() for p in module.net.parameters())
    for lg in trainer.loggers:
        lg.log_hyperparams(
            {"num_params": num_params, "seed": cfg.seed, "batch_size": cfg.data.batch_size}
        )

    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    train_time_s = time.perf_counter() - start
    if trainer.global_step <= start_step and not trainer.interrupted:
        # Nothing trained: metrics.json would describe a run that did not happen.
        raise ConfigError(
            f"no training step ran (global step {trainer.global_step}"
            + (f", as in {ckpt_path}" if ckpt_path else "")
            + "): "
            + (
                f"the checkpoint already reached trainer.max_epochs={cfg.trainer.max_epochs}; "
                "raise it to train on"
                if ckpt_path
                else f"trainer.limit_train_batches={cfg.trainer.get('limit_train_batches')} "
                "or the data leave no batch to train on"
            )
        )
    fit_metrics = {
        k: v for k, v in trainer.callback_metrics.items() if k.startswith(("train/", "val/"))
    }

    test_metrics: dict[str, Any] = {}
    best_ckpt = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    if cfg.get("test"):
        # The best checkpoint by val/acc; the current weights when no checkpoint was kept.
        trainer.test(module, datamodule=datamodule, ckpt_path=best_ckpt or None)
        test_metrics = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("test/")}

    metrics = {
        **fit_metrics,
        **test_metrics,
        "num_params": num_params,
        "model": _resolved(cfg.model),
        "train_time_s": round(train_time_s, 2),
        # The speed layer's choice (vit_mnist.speed): path, how it was chosen, its cost
        # (left out of train_time_s and fit_time_s) and the figures it was chosen on.
        "speed_path": choice.path,
        "speed_choice": choice.how,
        "speed_choice_s": round(choice.seconds, 3),
        "speed_allocator": choice.allocator,
        "speed_allocator_images_per_s": {
            k: round(v, 1) for k, v in choice.allocator_images_per_s.items()
        },
        "speed_images_per_s": {k: round(v, 1) for k, v in choice.images_per_s.items()},
        # First training step to the end of the last (validations included; process
        # start, data preparation, sanity check and test left out): the speedrun's clock.
        "fit_time_s": (
            round(throughput.fit_time_s, 2) if throughput and throughput.fit_time_s else None
        ),
        # torch.compile's warm-up before the first step (speed.path=compile), else None.
        "compile_time_s": (
            round(module.compile_time_s, 2) if module.compile_time_s is not None else None
        ),
        # Median over epochs of the training loop alone (no validation, no map logging),
        # for all processes together: DDP keeps them in step, so rank 0's rate x world size.
        "train_images_per_s": (
            round(throughput.median * trainer.world_size, 1)
            if throughput and throughput.median
            else None
        ),
        # The same, epoch by epoch: on a shared machine the rate can change from one epoch
        # to the next (docs/speed.md), which the median hides.
        "train_images_per_s_by_epoch": (
            [round(r * trainer.world_size, 1) for r in throughput.images_per_s]
            if throughput
            else None
        ),
        "world_size": trainer.world_size,
        "effective_batch_size": cfg.data.batch_size * trainer.world_size,
        "epochs": trainer.current_epoch,
        "global_steps": trainer.global_step,
        "device": describe_device(trainer.strategy.root_device, trainer.world_size),
        "precision": str(trainer.precision),
        "dataset": getattr(datamodule, "name", type(datamodule).__name__),
        "experiment": _experiment_name(),
        "data_source": getattr(datamodule, "source", None),
        "best_ckpt": best_ckpt or None,
        "seed": cfg.seed,
        "resumed_from": str(ckpt_path) if ckpt_path else None,
        "init_from": cfg.get("init_from"),
    }
    if not trainer.is_global_zero:
        # Under DDP every process has the same all-reduced metrics; one writes the file.
        return metrics
    return write_metrics(output_dir / "metrics.json", metrics)


@exit_on_user_error
def main(cfg: DictConfig) -> dict[str, Any]:
    """The body of ``python train.py``: ``train(cfg)``, bad input reported in one line.

    Exit status: 0 when done, 2 for bad input or a non-finite loss, 1 after Ctrl-C and
    143 after SIGTERM (both after saving ``last.ckpt``).
    """
    try:
        return train(cfg)
    except SIGTERMException:
        # Lightning's SIGTERMException is a SystemExit with status 0: make it a failure.
        raise SystemExit(128 + signal.SIGTERM) from None
