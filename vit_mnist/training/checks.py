"""What a training run checks before it reads any data or builds a model, in one place:
:func:`check_run`, called once per run by :func:`vit_mnist.tasks.train.train`.

A setting's own type, range and choices are the schema's (:mod:`vit_mnist.settings`);
the model's shape is the model's (:mod:`vit_mnist.models.checks`). Here are the checks of
one run's settings together, and against the checkpoint, the dataset and the machine.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from vit_mnist.data.augment import BatchAugment
from vit_mnist.data.sources import MNIST_MD5, raw_folder
from vit_mnist.errors import ConfigError
from vit_mnist.hardware import resolve_precision, uses_cuda
from vit_mnist.io import unwritable
from vit_mnist.models import check_model_args
from vit_mnist.models.checks import CONV_STEM_KEYS
from vit_mnist.settings import PRECISIONS, TrainSettings, check_settings, import_target
from vit_mnist.training.checkpointing import check_teacher


def resolved(node: Any) -> Any:
    """``node`` as plain Python values, interpolations resolved (None stays None)."""
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


def check_run(cfg: DictConfig, model: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Fail fast, before any data is read or a model is built, on settings that cannot work.

    Every key's type and range against the schema (vit_mnist/settings.py), then what needs
    more than one value or the machine: the model's shape, the model against the dataset,
    the augmentation's ranges together, the device and its precision, that the data
    directory can be written when the data must be fetched into it, a logger for the
    callbacks that write through one, and each logger's folder can be written.

    ``model``: the model's arguments when they are not ``cfg.model``'s (``init_from``'s).

    Returns:
        The teacher of a distillation run, as
        :func:`~vit_mnist.training.checkpointing.check_teacher` records it; None without one.

    Raises:
        ConfigError: one line naming the key, the value and what would be valid.
    """
    # Every key's type and range (seed_everything would truncate seed=1.5 to 1 while
    # metrics.json recorded 1.5); what follows checks values against each other.
    check_settings(cfg, TrainSettings)
    given = [key for key in CONV_STEM_KEYS if cfg.model.get(key) is not None]
    if given and cfg.model.get("stem") == "patch" and not cfg.get("init_from"):
        # Here, not in the model's checks: checkpoints of 2026-11-28 store [32, 64]
        # beside stem=patch, and they must still build (init_from builds the checkpoint's).
        # Every such key at once: an experiment (fashion_cpu_best) sets both.
        values = ", ".join(f"model.{key}={resolved(cfg.model[key])}" for key in given)
        nulls = " ".join(f"model.{key}=null" for key in given)
        raise ConfigError(
            f"{values}: used by the convolutional stem only; add model.stem=conv, or add "
            f"{nulls} (the experiment or model config may be what set them)"
        )
    model = model or resolved(cfg.model)
    check_model_args(model)
    data = cfg.data
    if data.get("augment"):
        # Its ranges together (scale as [min, max], min <= max), which no one field states.
        BatchAugment(**resolved(data.augment))
    # check_settings has imported data._target_ already; only "is it a class" is new here.
    datamodule_cls = import_target(data._target_)
    if not inspect.isclass(datamodule_cls):
        raise ConfigError(
            f"data._target_={data._target_} is not a class; "
            "use data=mnist, data=fashion_mnist or data=synthetic"
        )
    _check_model_fits_data(model, datamodule_cls)
    teacher = check_teacher(cfg.module, model, data._target_)
    if data.get("data_dir") is not None:
        _check_data_dir(str(data.data_dir), getattr(datamodule_cls, "folder", "MNIST"))
    _check_device(cfg.trainer)
    _check_remeasure(cfg.get("speed") or {}, str(cfg.trainer.get("precision", "auto")))
    _check_loggers_for(cfg.get("callbacks") or {}, cfg.get("logger") or {})
    _check_log_folders(cfg.get("logger") or {})
    return teacher


def _check_remeasure(speed: DictConfig | dict, precision: str) -> None:
    """``speed.remeasure=true`` times the candidates afresh: with the path and the precision
    both forced (or a forced compiled path) nothing is timed, and it would not be applied."""
    path = speed.get("path", "auto")
    if not speed.get("remeasure") or path == "auto" or (precision == "auto" and path != "compile"):
        return
    raise ConfigError(
        f"speed.remeasure=true times the speed paths afresh, and speed.path={path} with "
        f"trainer.precision={precision} times nothing: drop speed.remeasure, or use "
        "speed.path=auto"
    )


def _check_loggers_for(callbacks: DictConfig | dict, loggers: DictConfig | dict) -> None:
    """A callback that writes through a logger (Lightning's ``LearningRateMonitor``, which
    otherwise stops the run once fitting starts) needs one that is on."""
    if any(loggers.values()):
        return
    for name, callback in callbacks.items():
        if callback and str(callback.get("_target_", "")).endswith(".LearningRateMonitor"):
            raise ConfigError(
                f"callbacks.{name} writes the learning rate to a logger, and every logger is "
                f"off; turn it off as well (~logger callbacks.{name}=null) or keep a logger "
                "(logger=tensorboard)"
            )


def _check_log_folders(loggers: DictConfig | dict) -> None:
    """Each logger's folder can be written: TensorBoard's and the CSV logger's ``save_dir``,
    the folder of MLflow's local store (``sqlite:///PATH`` or ``file:PATH``; a server is not
    checked). MLflow retried a read-only store for two minutes, then gave a traceback."""
    for name, logger in loggers.items():
        if not logger:
            continue
        key, folder = "save_dir", logger.get("save_dir")
        if logger.get("tracking_uri") is not None:
            key, folder = "tracking_uri", None
            scheme, _, rest = str(logger.tracking_uri).partition(":")
            if scheme == "sqlite":  # sqlite:///rel.db, sqlite:////abs.db (SQLAlchemy's URL)
                folder = Path(rest.removeprefix("///")).parent
            elif scheme == "file":  # file:///abs, file:rel
                folder = Path(rest.removeprefix("//"))
        why = unwritable(folder) if folder is not None else None
        if why:
            value = logger.get(key)
            # MLflow's store is under paths.log_dir, the others' folders in the run dir.
            moved = "paths.log_dir=PATH" if key == "tracking_uri" else "hydra.run.dir=PATH"
            raise ConfigError(
                f"logger.{name}.{key}={value} cannot be written ({why}); choose a folder you "
                f"can write: {moved}, or logger.{name}.{key}=..."
            )
