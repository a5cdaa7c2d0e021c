"""Checkpoints: reading them safely, resolving ``latest``, resuming (``ckpt_path``) or starting
from one (``init_from``), rebuilding the data they were trained on, writing them atomically."""

from __future__ import annotations

import io
import json
import logging
import os
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from omegaconf import DictConfig, OmegaConf

from vit_mnist.errors import CheckpointError, ConfigError, WriteError
from vit_mnist.io import atomic_write_bytes
from vit_mnist.models.checks import CONV_STEM_KEYS, conv_stem_layout
from vit_mnist.settings import EvalSettings, check_settings, import_target
from vit_mnist.training.module import RUN_INFO_KEY, ViTClassifier

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
        try:
            atomic_write_bytes(path, buffer.getvalue())
        except WriteError as e:
            last = Path(path).with_name("last.ckpt")
            hint = f" Make room, then resume: {resume_command(last)}" if last.is_file() else ""
            raise WriteError(f"{e}.{hint}", e.errno) from e


# Model arguments that change neither the parameters nor the function computed: explicit
# and fused attention compute the same thing; `compile` was a model key in older versions.
_NOT_MODEL_IDENTITY = frozenset({"attention_impl", "compile"})


def model_differences(stored: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """The model arguments that differ between a checkpoint and a config, as
    ``"model.KEY: STORED (checkpoint) vs WANTED (config)"``; empty when they match.

    A key that only one side has (an argument added or removed since the checkpoint
    was written) is not a difference: its default applies. Values are compared as the
    network is built with them (:func:`_built`), and a key both sides give alike is not a
    difference even where its built value differs: that follows from another key, which
    is named (null strides follow the channels).
    """
    built_stored, built_wanted = _built(stored), _built(wanted)
    keys = sorted((built_stored.keys() & built_wanted.keys()) - _NOT_MODEL_IDENTITY)
    return [
        f"model.{k}: {built_stored[k]} (checkpoint) vs {built_wanted[k]} (config)"
        for k in keys
        if built_stored[k] != built_wanted[k] and stored.get(k) != wanted.get(k)
    ]


def _built(model: dict[str, Any]) -> dict[str, Any]:
    """``model`` with ``stem_channels`` and ``stem_strides`` as the network is built with
    them: dropped for the patch embedding (checkpoints of 2026-11-28 store [32, 64] there),
    the conv stem's defaults for null or left out (checkpoints before stem_strides)."""
    if model.get("stem", "patch") == "patch":
        return {k: v for k, v in model.items() if k not in CONV_STEM_KEYS}
    layout = conv_stem_layout(model["patch_size"], *(model.get(k) for k in CONV_STEM_KEYS))
    return {**model, **dict(zip(CONV_STEM_KEYS, layout, strict=True))}


def resolve_latest(
    value: str | Path, log_dir: str | Path, pattern: str, model: dict[str, Any] | None = None
) -> Path:
    """``value`` as a path, or for ``"latest"`` the newest ``pattern`` under ``log_dir``.

    With ``model`` (the config's model arguments), ``latest`` is the newest checkpoint
    whose stored model arguments match them (:func:`model_differences`), so that a run
    is never continued from another model's checkpoint; unreadable files are passed over.

    Raises:
        CheckpointError: ``latest`` was asked for and nothing (nothing of this model)
            matches; the message names the newest candidate and how it differs.
    """
    if str(value) != "latest":
        return Path(value)
    found = sorted(
        filter(Path.is_file, Path(log_dir).rglob(pattern)), key=os.path.getmtime, reverse=True
    )
    if not found:
        raise CheckpointError(
            f"ckpt_path=latest: no {pattern} under {log_dir}; train first or give a path"
        )
    if model is None:
        log.info("ckpt_path=latest -> %s", found[0])
        return found[0]
    detail = None  # how the newest readable one differs
    for path in found:
        try:
            stored = read_checkpoint(path)["hyper_parameters"]["model"]
        except CheckpointError:
            continue
        differences = model_differences(stored, model)
        if not differences:
            log.info("ckpt_path=latest -> %s", path)
            return path
        detail = detail or f"the newest, {path}, differs in {'; '.join(differences)}"
    detail = detail or "none of them can be read"
    raise CheckpointError(
        f"ckpt_path=latest: none of the {len(found)} {pattern} under {log_dir} was trained "
        f"with this model ({detail}); give ckpt_path=PATH, or the model settings it was "
        "trained with, or leave ckpt_path out to start a new run"
    )


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint of this project safely (``torch.load(weights_only=True)``), on CPU.

    Returns:
        The checkpoint dict, with ``hyper_parameters`` (the model's arguments) and the
        run info (data config, precision, seed) that ``train`` stored.

    Raises:
        CheckpointError: the file is missing, unreadable or truncated, is not a checkpoint
            written by vit_mnist, or holds weights that are NaN or infinite (damaged); the
            message names the path.
    """
    path = Path(path)
    if path.is_dir():
        found = sorted(path.rglob("*.ckpt"))[:3]
        hint = ", e.g. " + ", ".join(map(str, found)) if found else ""
        raise CheckpointError(f"checkpoint {path} is a folder; give a .ckpt file inside it{hint}")
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {path} does not exist; give ckpt_path=<run dir>/checkpoints/<file>.ckpt"
        )
    try:
        with path.open("rb") as f:
            head = f.read(2)
        # torch.save writes a zip archive ("PK"); before torch 1.6 a pickle (protocol
        # byte 0x80). Anything else (text, an image, an empty file) would fail in the
        # unpickler with a message about its bytes, such as "KeyError: 101".
        if head != b"PK" and head[:1] != b"\x80":
            raise CheckpointError(
                f"checkpoint {path} is not a PyTorch checkpoint (neither a zip archive nor a "
                "pickle); give ckpt_path=<run dir>/checkpoints/<file>.ckpt written by train.py"
            )
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:
        # weights_only=True runs no code from the file, so whatever fails while parsing
        # (a text file gives KeyError, a cut one EOFError or BadZipFile) means the same:
        # this is not a readable checkpoint.
        text = str(e).strip()
        first = text.splitlines()[0].split(". ")[0] if text else ""
        first = f"{type(e).__name__}: {first}" if isinstance(e, KeyError) or not first else first
        raise CheckpointError(
            f"checkpoint {path} cannot be read (truncated or not a checkpoint?): {first}"
        ) from e
    if (
        not isinstance(ckpt, dict)
        or "state_dict" not in ckpt
        or "model" not in ckpt.get("hyper_parameters", {})
    ):
        raise CheckpointError(
            f"{path} is not a vit_mnist checkpoint (no model arguments stored in it)"
        )
    # Training stops on a non-finite loss before it saves (NonFiniteLossError), so NaN or
    # infinite weights are damage: evaluated, they gave chance accuracy and a NaN loss.
    for name, tensor in ckpt["state_dict"].items():
        if torch.is_tensor(tensor) and tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise CheckpointError(
                    f"checkpoint {path} is damaged: {name} holds {bad} NaN or infinite "
                    f"value(s) of {tensor.numel()}; use another checkpoint of the run, e.g. "
                    "its last.ckpt or best-*.ckpt"
                )
    return ckpt


def load_model(ckpt_path: str | Path) -> tuple[ViTClassifier, dict[str, Any]]:
    """The model of a checkpoint, on the CPU in eval mode, and its stored data config (the
    ``data`` section of the run it was trained in; empty when it stores none).

    Raises:
        CheckpointError: see :func:`read_checkpoint`.
    """
    ckpt = read_checkpoint(ckpt_path)
    module = ViTClassifier.load_from_checkpoint(ckpt_path, map_location="cpu", weights_only=True)
    return module.eval(), ckpt.get(RUN_INFO_KEY, {}).get("data", {})


def _dataset_name(target: str | None) -> str | None:
    """The ``name`` of the data module a ``_target_`` names (``mnist``), or the target."""
    if not target:
        return None
    try:
        return getattr(import_target(target), "name", target)
    except ImportError:
        return target


def check_teacher(
    module: Mapping[str, Any], model: dict[str, Any], data_target: str | None = None
) -> dict[str, Any] | None:
    """A distillation run's teacher (``module.teacher_ckpt``, softened by
    ``module.distillation_tau``) against its student's arguments ``model`` and data module
    ``data_target``: the teacher and the distillation token both or neither set, a
    temperature only with a teacher, the file a checkpoint of this project, and the teacher
    trained on the same dataset (as its stored data config says) and classifying the same
    images into as many classes.

    Returns:
        None without a teacher; else its record for the student's ``metrics.json`` and
        checkpoints: ``ckpt`` (the path), ``dataset``, ``val_acc_best`` (a fraction, from
        the teacher's checkpoint) and ``test_acc`` (from the ``metrics.json`` of the run
        that wrote it, None where that is not beside it).

    Raises:
        ConfigError: one setting without the other, or a teacher of another dataset or shape.
        CheckpointError: see :func:`read_checkpoint`.
    """
    teacher_ckpt, tau = module.get("teacher_ckpt"), module.get("distillation_tau")
    if tau is not None and not teacher_ckpt:
        raise ConfigError(
            f"module.distillation_tau={tau} softens a teacher's outputs, and there is no "
            "teacher: add module.teacher_ckpt=PATH and model.distillation=true, or leave "
            "module.distillation_tau out"
        )
    if bool(model.get("distillation")) != bool(teacher_ckpt):
        if teacher_ckpt:
            raise ConfigError(
                f"module.teacher_ckpt={teacher_ckpt} teaches a distillation token: add "
                "model.distillation=true, or leave module.teacher_ckpt out"
            )
        raise ConfigError(
            "model.distillation=true needs a teacher: module.teacher_ckpt=PATH (a checkpoint "
            "written by train.py, e.g. outputs/train/runs/<run>/checkpoints/best-....ckpt)"
        )
    if not teacher_ckpt:
        return None
    ckpt = read_checkpoint(teacher_ckpt)
    teacher = ckpt["hyper_parameters"]["model"]
    theirs = _dataset_name(ckpt.get(RUN_INFO_KEY, {}).get("data", {}).get("_target_"))
    ours = _dataset_name(data_target)
    if theirs and ours and theirs != ours:
        # Same shapes (Fashion-MNIST and MNIST), other classes: its labels would be noise.
        raise ConfigError(
            f"module.teacher_ckpt={teacher_ckpt} was trained on {theirs}, this run trains on "
            f"{ours}: give a teacher trained on {ours} (experiment=cnn_teacher data={ours})"
        )
    for key, default in (("num_classes", 10), ("img_size", 28), ("in_chans", 1)):
        theirs_value, ours_value = teacher.get(key, default), model.get(key, default)
        if theirs_value != ours_value:
            raise ConfigError(
                f"module.teacher_ckpt={teacher_ckpt} has {key}={theirs_value}, this model "
                f"model.{key}={ours_value}: give a teacher trained on the same data"
            )
    try:
        run_metrics = json.loads((Path(teacher_ckpt).parent.parent / "metrics.json").read_text())
        test_acc = float(run_metrics["test/acc"])
    except (OSError, ValueError, KeyError, TypeError):
        test_acc = None
    best = ckpt.get("val_acc_best")
    return dict(ckpt=str(teacher_ckpt), dataset=theirs, val_acc_best=best, test_acc=test_acc)


def resolve_ckpt_path(cfg: DictConfig) -> Path:
    """``cfg.ckpt_path`` as a path; ``latest`` is the newest ``best-*.ckpt`` under outputs/.

    Raises:
        CheckpointError: no ``ckpt_path`` given, or ``latest`` finds no checkpoint.
    """
    if OmegaConf.is_missing(cfg, "ckpt_path") or not cfg.ckpt_path:
        raise CheckpointError(
            "ckpt_path is required: python eval.py "
            "ckpt_path=outputs/train/runs/<run>/checkpoints/<best-...>.ckpt (or ckpt_path=latest)"
        )
    return resolve_latest(cfg.ckpt_path, cfg.paths.log_dir, "best-*.ckpt")


def checkpoint_datamodule(
    cfg: DictConfig, ckpt_path: str | Path, run_info: dict[str, Any]
) -> L.LightningDataModule:
    """The datamodule a checkpoint was trained on, or ``cfg.data`` when that names a dataset
    of its own (``data=fashion_mnist``); keys of ``cfg.data`` without a ``_target_``
    (``+data.batch_size=512``) change the checkpoint's.

    The stored ``data_dir`` is replaced by this run's ``paths.data_dir``: the training
    machine's folder may not exist here.

    Raises:
        CheckpointError: the checkpoint stores no data config and ``cfg.data`` names none.
        ConfigError: a key of ``cfg.data`` that the checkpoint's data module does not take.
    """
    given = cfg.get("data")
    if given is not None and "_target_" in given:
        return hydra.utils.instantiate(given)
    if "data" not in run_info:
        raise CheckpointError(f"{ckpt_path} stores no data config; pass data=mnist (or another)")
    data_cfg = OmegaConf.create(run_info["data"])
    if "data_dir" in data_cfg:
        data_cfg.data_dir = cfg.paths.data_dir
    if given:
        # Each given key's type and range were checked with the command's settings; whether
        # the stored data module takes it needs that module.
        check_settings(
            OmegaConf.create({"data": {**given, "_target_": data_cfg._target_}}), EvalSettings
        )
        data_cfg = OmegaConf.merge(data_cfg, given)
    return hydra.utils.instantiate(data_cfg)


def resume_command(ckpt: Path | None) -> str:
    """The command line that resumes this run from ``ckpt``: the same program as the user
    started (``python train.py`` or ``vit-mnist-train``), the same overrides, a new ckpt_path.

    With ``ckpt=None``: the command as it was given, ``ckpt_path`` included. The run's own
    ``hydra.*`` overrides come too (its run dir; ``hydra.mode=RUN`` over an experiment that
    sweeps, such as ``heads_sweep``), and one job of a sweep resumes as a run in its folder.
    """
    overrides = []  # none outside @hydra.main (tests, notebooks)
    if HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
        overrides = list(hydra_cfg.overrides.task)
        if hydra_cfg.mode == RunMode.MULTIRUN:
            overrides += [f"hydra.run.dir={hydra_cfg.runtime.output_dir}", "hydra.mode=RUN"]
        else:
            overrides += list(hydra_cfg.overrides.hydra)
    if ckpt is not None:
        overrides = [o for o in overrides if not o.startswith("ckpt_path=")]
        overrides.append(f"ckpt_path={ckpt}")
    # How the user started this program: `python train.py` (as typed, with its folder) or a
    # console script such as `vit-mnist-train`, which works from any folder.
    program = sys.argv[0] if sys.argv and sys.argv[0] else "train.py"
    started = ["python", program] if program.endswith(".py") else [Path(program).name]
    return shlex.join([*started, *overrides])


@dataclass
class Resume:
    """What ``ckpt_path`` resumes: the checkpoint (None: a new run), its global step, and
    the ``module`` settings (``ViTClassifier`` arguments) it keeps over the config's
    (:data:`RESUMED_MODULE_KEYS`)."""

    path: Path | None = None
    start_step: int = 0
    module: dict[str, Any] = field(default_factory=dict)


# The module settings a resume takes from the checkpoint: Lightning restores the optimizer
# and the learning-rate schedule (their state holds these), whatever the command line says.
RESUMED_MODULE_KEYS = ("lr", "weight_decay", "betas", "warmup_epochs", "min_lr_ratio")


def _check_not_finished(path: Path, ckpt: dict[str, Any], trainer: DictConfig) -> None:
    """Refuse a checkpoint that has already trained ``trainer.max_epochs`` epochs (its
    ``epoch`` counts the finished ones) or ``trainer.max_steps`` steps: the run would train
    nothing, so it stops here, before the data are read or the speed paths timed."""
    epochs, max_epochs = int(ckpt.get("epoch", 0)), trainer.get("max_epochs")
    if max_epochs is not None and max_epochs != -1 and epochs >= max_epochs:
        reached = "more than" if epochs > max_epochs else "all of"
        raise ConfigError(
            f"ckpt_path={path} has trained {epochs} epochs, {reached} trainer.max_epochs="
            f"{max_epochs}: nothing is left to train. Set trainer.max_epochs above {epochs} "
            "to train on, or leave ckpt_path out to start a new run"
        )
    steps, max_steps = int(ckpt.get("global_step", 0)), trainer.get("max_steps")
    if max_steps is not None and max_steps > 0 and steps >= max_steps:
        raise ConfigError(
            f"ckpt_path={path} has trained {steps} steps, trainer.max_steps={max_steps}: "
            f"nothing is left to train. Set trainer.max_steps above {steps} to train on"
        )


def resume_checkpoint(cfg: DictConfig) -> Resume:
    """For ``ckpt_path=PATH`` (or ``latest``): the checkpoint to resume, its global step and
    the module settings it keeps (its :data:`RESUMED_MODULE_KEYS` that differ from
    ``cfg.module``'s); an empty :class:`Resume` without ``ckpt_path``. Each kept setting is
    named in one warning line and recorded beside the composed config, in the run's
    ``.hydra/resumed.yaml`` (``module.<key>``: ``asked`` and ``kept``); ``cfg`` and
    ``.hydra/config.yaml`` stay what the user composed.

    Raises:
        ConfigError: the checkpoint was trained with another model than ``cfg.model``, or
            for ``trainer.max_epochs`` epochs or more (or ``max_steps``: nothing left to train),
            or with another ``data.batch_size``
            (the schedule's step count and the epoch's batches were laid out for its own).
        CheckpointError: see :func:`read_checkpoint`.
    """
    if cfg.get("ckpt_path") is None:
        return Resume()
    model_args = OmegaConf.to_container(cfg.model, resolve=True)
    path = resolve_latest(cfg.ckpt_path, cfg.paths.log_dir, "last.ckpt", model_args)
    ckpt = read_checkpoint(path)  # a clear error for a missing or foreign file
    saved = ckpt["hyper_parameters"]
    differences = model_differences(saved["model"], model_args)
    if differences:
        raise ConfigError(
            f"ckpt_path={path} was trained with another model: {'; '.join(differences)}. "
            "Resume it with its own model settings, or leave ckpt_path out to start a new run"
        )
    # Lightning refuses this after the restore, with a traceback; said here in one line.
    _check_not_finished(path, ckpt, cfg.trainer)
    batch_size = ckpt.get(RUN_INFO_KEY, {}).get("data", {}).get("batch_size")
    if batch_size is not None and batch_size != cfg.data.batch_size:
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size} differs from the {batch_size} that "
            f"{path} trained with: resume with data.batch_size={batch_size}, or start a new "
            f"run from its weights with init_from={path}"
        )
    module = OmegaConf.to_container(cfg.module, resolve=True)
    kept = {}
    for key in RESUMED_MODULE_KEYS:
        if key in saved and key in module:
            value = list(saved[key]) if isinstance(saved[key], tuple) else saved[key]
            if module[key] != value:
                kept[key] = value
    if kept:
        record = {f"module.{k}": {"asked": module[k], "kept": v} for k, v in kept.items()}
        resumed = Path(cfg.paths.output_dir) / ".hydra" / "resumed.yaml"
        atomic_write_bytes(resumed, OmegaConf.to_yaml(OmegaConf.create(record)).encode())
        log.warning(
            "%s ignored: the optimizer and its schedule resume from %s; start a new run "
            "with init_from=%s to train with other settings",
            ", ".join(f"module.{k}={module[k]} (keeps {v})" for k, v in kept.items()),
            path,
            path,
        )
    return Resume(path, int(ckpt.get("global_step", 0)), kept)


# Model arguments that a run started from a checkpoint's weights can take over them: they
# change neither the parameters' shapes nor what the weights mean (regularisation, and the
# attention's implementation).
_OVER_WEIGHTS = frozenset({"dropout", "attn_dropout", "drop_path_rate"}) | _NOT_MODEL_IDENTITY


def _model_keys_given() -> set[str]:
    """The ``model.*`` keys the command line sets (``model.depth=3``, ``+model.x=1``), and
    ``arch`` for a ``model=NAME``; empty outside Hydra."""
    if not HydraConfig.initialized():
        return set()
    given = set()
    for override in HydraConfig.get().overrides.task:
        key, eq, _ = override.lstrip("+").partition("=")
        if eq and key == "model":
            given.add("arch")
        elif eq and key.startswith("model."):
            given.add(key.split(".")[1])
    return given


@dataclass
class StartFrom:
    """What ``init_from`` starts a run from: the model's arguments, its network's weights
    (``net.*`` without the prefix) and, for a model pruned by ``eval.py analysis=prune``,
    what it was pruned from (its run info's ``pruned_from``)."""

    model: dict[str, Any]
    weights: dict[str, torch.Tensor]
    pruned_from: dict[str, Any] | None = None


def model_to_start_from(cfg: DictConfig) -> StartFrom | None:
    """For ``init_from=PATH``: that checkpoint's model arguments (with the command line's
    regularisation over them) and its network weights; None without ``init_from``. ``cfg``
    is not changed.

    A ``model.*`` key given on the command line that only regularises (``dropout``,
    ``drop_path_rate``, ...) is applied over the checkpoint's; any other that differs from
    the checkpoint's is refused, since the weights fix it. The config's other model values
    that differ (its preset's) are named in one warning line: the checkpoint's are kept.

    Raises:
        ConfigError: ``init_from`` together with ``ckpt_path``, or a model key given that
            the checkpoint's weights cannot take.
        CheckpointError: see :func:`read_checkpoint`.
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
    stored = ckpt["hyper_parameters"]["model"]
    wanted = OmegaConf.to_container(cfg.model, resolve=True)
    given = _model_keys_given()
    model, refused, kept = dict(stored), [], []
    # Values that build the same network (stem_channels beside the patch embedding) differ
    # in name only: not worth a warning.
    built_stored, built_wanted = _built(stored), _built(wanted)
    for key in sorted(wanted):
        if key in stored and wanted[key] == stored[key]:
            continue
        shown = f"model.{key}={wanted[key]} (checkpoint: {stored.get(key, 'its default')})"
        if key in given and key in _OVER_WEIGHTS:
            model[key] = wanted[key]
        elif key in given:
            refused.append(shown)
        elif key in stored and built_stored.get(key) != built_wanted.get(key):
            kept.append(f"model.{key}={stored[key]} (config: {wanted[key]})")
    if refused:
        raise ConfigError(
            f"init_from={path} trains that checkpoint's weights, which fix its model: "
            f"{'; '.join(refused)} cannot be applied. Leave it out, or drop init_from to "
            "train a new model"
        )
    if kept:
        log.warning("init_from=%s: the checkpoint's model trains: %s", path, ", ".join(kept))
    log.info("init_from=%s: model %s, training from epoch 0", path, model)
    net = {k.removeprefix("net."): v for k, v in ckpt["state_dict"].items() if k.startswith("net.")}
    return StartFrom(model, net, ckpt.get(RUN_INFO_KEY, {}).get("pruned_from"))
