"""Command-line entry points: ``python train.py`` and the console script ``vit-mnist-train``
are the same function, and so on for eval, predict and export.

The configs are read from the package ``vit_mnist.configs``, which is the top-level
``configs/`` folder of a source checkout (see ``[tool.setuptools.package-dir]`` in
pyproject.toml), so an installed wheel finds them too. Run dirs, data and checkpoints
go under the current directory (``paths.root_dir``), exactly as with ``python train.py``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from functools import wraps
from types import ModuleType
from typing import Any

import hydra
from omegaconf import DictConfig

CONFIG_PATH = "pkg://vit_mnist.configs"


def _exits_1_after_failed_jobs(main: Callable[[], Any]) -> Callable[[], Any]:
    """Exit status 1 after a multirun in which a job stopped on a user error (each such
    job wrote ``failed.json`` and the others ran: :func:`vit_mnist.errors.exit_on_user_error`)."""

    @wraps(main)
    def wrapper() -> Any:
        result = main()
        from vit_mnist.errors import FAILED_JOBS

        if FAILED_JOBS:
            print(f"{len(FAILED_JOBS)} job(s) of the sweep failed:", file=sys.stderr)
            for job_dir, message in FAILED_JOBS:
                print(f"  {job_dir}: {message}", file=sys.stderr)
            raise SystemExit(1)
        return result

    return wrapper


def _start(task: str) -> ModuleType:
    """Import ``vit_mnist.<task>`` (torch, Lightning: seconds) and quiet the console.

    Ctrl-C during these imports ends the program with one line and status 130 (128 +
    SIGINT), not a traceback through the importers: nothing has been run or written yet.
    """
    try:
        module = importlib.import_module(f"vit_mnist.{task}")
        from vit_mnist.console import quiet_console
    except KeyboardInterrupt:
        print("\nInterrupted while starting up: nothing was run or written.", file=sys.stderr)
        raise SystemExit(130) from None
    quiet_console()
    return module


@_exits_1_after_failed_jobs
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="train")
def train(cfg: DictConfig) -> dict[str, Any]:
    """``vit-mnist-train [overrides]`` = ``python train.py [overrides]``."""
    return _start("train").main(cfg)


@_exits_1_after_failed_jobs
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="eval")
def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """``vit-mnist-eval ckpt_path=PATH`` = ``python eval.py ckpt_path=PATH``."""
    return _start("evaluate").main(cfg)


@_exits_1_after_failed_jobs
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="predict")
def predict(cfg: DictConfig) -> Any:
    """``vit-mnist-predict ckpt_path=PATH images=[a.png]`` = ``python scripts/predict.py ...``."""
    return _start("predict").main(cfg)


@_exits_1_after_failed_jobs
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="export")
def export(cfg: DictConfig) -> Any:
    """``vit-mnist-export ckpt_path=PATH format=onnx`` = ``python scripts/export.py ...``."""
    return _start("export").main(cfg)
