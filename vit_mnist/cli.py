"""Command-line entry points: ``python train.py`` and the console script ``vit-mnist-train``
are the same function, and so on for eval, predict and export.

The configs are read from the package ``vit_mnist.configs``, which is the top-level
``configs/`` folder of a source checkout (see ``[tool.setuptools.package-dir]`` in
pyproject.toml), so an installed wheel finds them too. Run dirs, data and checkpoints
go under the current directory (``paths.root_dir``), exactly as with ``python train.py``.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import sys
from collections.abc import Callable
from functools import wraps
from types import ModuleType
from typing import Any

import hydra
from omegaconf import DictConfig

CONFIG_PATH = "pkg://vit_mnist.configs"
_ENV_AT_START = dict(os.environ)


_STARTED: list[str] = []  # the task whose body has begun (see _start)


def _command_line(main: Callable[[], Any]) -> Callable[[], Any]:
    """Wrap a ``@hydra.main`` function for the command line.

    - Hydra's own errors before the task runs (an unknown key, a group option that does
      not exist, an override it cannot parse, a run dir it cannot create) become one line
      on stderr and exit status 2, with the fix: the nearest setting's name, or the right
      ``+``/``++`` form. Hydra prints them itself, over several lines, unless
      ``HYDRA_FULL_ERROR`` is set; it is set here so they reach this wrapper (a user who set
      it gets Hydra's full report as before).
    - Exit status 1 after a multirun in which a job stopped on a user error (each such job
      wrote ``failed.json`` and the others ran: :func:`vit_mnist.errors.exit_on_user_error`).
    """

    @wraps(main)
    def wrapper() -> Any:
        user_wants_full_errors = bool(os.environ.get("HYDRA_FULL_ERROR"))
        os.environ["HYDRA_FULL_ERROR"] = "1"
        try:
            result = main()
        except Exception as e:
            line = None if user_wants_full_errors else _hydra_error_line(e, main.__name__)
            if line is None:
                raise
            print(f"error: {line}", file=sys.stderr)
            raise SystemExit(2) from None
        from vit_mnist.errors import FAILED_JOBS

        if FAILED_JOBS:
            print(f"{len(FAILED_JOBS)} job(s) of the sweep failed:", file=sys.stderr)
            for job_dir, message in FAILED_JOBS:
                print(f"  {job_dir}: {message}", file=sys.stderr)
            raise SystemExit(1)
        return result

    return wrapper


def _hydra_error_line(error: Exception, command: str) -> str | None:
    """One line for an error Hydra raised before the task began; None for anything else."""
    from hydra.errors import (
        ConfigCompositionException,
        HydraException,
        MissingConfigException,
        OverrideParseException,
    )

    if _STARTED:
        return None
    text = str(error).strip()
    quoted = re.findall(r"'([^']*)'", text)
    if isinstance(error, OverrideParseException):
        return (
            f"cannot read the override: {text.splitlines()[0]} (quote lists and values with "
            "spaces: 'model.num_heads=[2,4]'; grammar: "
            "https://hydra.cc/docs/advanced/override_grammar/basic/)"
        )
    if isinstance(error, MissingConfigException):
        if text.startswith("Primary config module"):
            # configs/ is the package vit_mnist.configs only once the project is installed.
            return (
                f"{text.splitlines()[0]} Install the project first: pip install -e . in the "
                "checkout (the README's quick start)"
            )
        missing = re.search(r"Could not (?:find|load) '([^']+)'", text)
        options = re.findall(r"^\t(\S+)$", text.split("Config search path")[0], re.M)
        if missing and "/" in missing.group(1):
            group, _, option = missing.group(1).rpartition("/")
            return (
                f"{group}={option} is not an option of {group}; choose one of {options} "
                f"(the files in configs/{group}/)"
            )
        return text.splitlines()[0]
    if isinstance(error, ConfigCompositionException):
        if text.startswith("Could not override") and quoted:
            return _unknown_override(quoted[0], text, command)
        if text.startswith("Could not append") and len(quoted) >= 2:
            key = quoted[0]
            return (
                f"{key} is a setting already: drop the + ({quoted[1]}), or write ++ to set a "
                f"key whether or not it exists ({quoted[-1]})"
            )
        return " ".join(text.split())
    if isinstance(error, OSError) and error.filename:
        return (
            f"cannot create the run dir {error.filename}: {error.strerror}; choose a folder "
            "you can write with hydra.run.dir=PATH (or hydra.sweep.dir=PATH with -m)"
        )
    if isinstance(error, HydraException):
        return " ".join(text.split())
    return None


# Sections built from a class: any argument of the class may be added with a +.
_OPEN_SECTIONS = ("trainer", "callbacks", "logger", "data")


def _unknown_override(key: str, text: str, command: str) -> str:
    """``model.num_head=4``: the nearest setting, or how to add an argument with ``+``."""
    from vit_mnist.settings import RETIRED, SETTINGS, known_keys

    if key in RETIRED:
        return f"{key} {RETIRED[key]}"
    assignment = re.search(r"use \+(\S+)", text)
    value = assignment.group(1).partition("=")[2] if assignment else "..."
    section, _, name = key.rpartition(".")
    keys = known_keys(SETTINGS[command], section)
    if name in keys:  # a setting that this config's YAML leaves out
        return f"{key} is not set by this config; add it with a +: +{key}={value}"
    close = difflib.get_close_matches(name, keys, n=1)
    if close:
        nearest = f"{section}.{close[0]}" if section else close[0]
        if section.split(".")[0] in _OPEN_SECTIONS:  # the YAML may not set it yet
            return (
                f"{key} is not a setting; did you mean {nearest}? ({nearest}={value}, or "
                f"+{nearest}={value} where the config does not set it yet)"
            )
        return f"{key} is not a setting; did you mean {nearest}? ({nearest}={value})"
    if section.split(".")[0] in _OPEN_SECTIONS:
        return (
            f"{key} is not in the config; to pass one more argument to {section}'s class, "
            f"add it with a +: +{key}={value}"
        )
    listed = ", ".join(k for k in keys if not k.startswith("_"))
    where = f"of {section}" if section else "at the top level"
    return f"{key} is not a setting {where} (the settings there: {listed})"


def _start(task: str) -> ModuleType:
    """Import ``vit_mnist.<task>`` (torch, Lightning: seconds) and quiet the console.

    Ctrl-C during these imports ends the program with one line and status 130 (128 +
    SIGINT), not a traceback through the importers: nothing has been run or written yet.
    """
    _STARTED.append(task)
    try:
        module = importlib.import_module(f"vit_mnist.{task}")
        from vit_mnist.console import quiet_console
    except KeyboardInterrupt:
        print("\nInterrupted while starting up: nothing was run or written.", file=sys.stderr)
        raise SystemExit(130) from None
    quiet_console()
    return module


def prepare_ddp_launch(trainer_cfg: DictConfig) -> None:
    """Let Lightning's DDP start its extra processes as this one job, not as the sweep.

    Lightning starts DDP's extra processes by running ``sys.argv`` again in
    ``HydraConfig.run.dir``; inside a local multirun (``-m``) that command line is the whole
    sweep and that folder is not the job's. So the command line becomes this job's own
    overrides with ``hydra.mode=RUN``, and ``run.dir`` this job's run dir. Under SLURM
    (submitit) or torchrun the processes are started outside, one per task, and nothing is
    re-run.
    """
    import torch
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
    from omegaconf import open_dict, read_write

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
        if key in _ENV_AT_START:
            os.environ[key] = _ENV_AT_START[key]
        else:
            os.environ.pop(key, None)
    hydra_cfg = HydraConfig.get()
    sys.argv = [sys.argv[0], *hydra_cfg.overrides.task, "hydra.mode=RUN"]
    with read_write(hydra_cfg), open_dict(hydra_cfg):
        hydra_cfg.run.dir = hydra_cfg.runtime.output_dir


@_command_line
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="train")
def train(cfg: DictConfig) -> dict[str, Any]:
    """``vit-mnist-train [overrides]`` = ``python train.py [overrides]``."""
    task = _start("train")
    prepare_ddp_launch(cfg.trainer)
    return task.main(cfg)


@_command_line
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="eval")
def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """``vit-mnist-eval ckpt_path=PATH`` = ``python eval.py ckpt_path=PATH``."""
    return _start("evaluate").main(cfg)


@_command_line
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="predict")
def predict(cfg: DictConfig) -> Any:
    """``vit-mnist-predict ckpt_path=PATH images=[a.png]`` = ``python scripts/predict.py ...``."""
    return _start("predict").main(cfg)


@_command_line
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="export")
def export(cfg: DictConfig) -> Any:
    """``vit-mnist-export ckpt_path=PATH format=onnx`` = ``python scripts/export.py ...``."""
    return _start("export").main(cfg)
