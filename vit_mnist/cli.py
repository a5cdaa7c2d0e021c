"""Command-line entry points: ``python train.py`` and the console script ``vit-mnist-train``
are the same function, and so on for eval, predict, export and explore.

The configs are read from the package ``vit_mnist.configs``, which is the top-level
``configs/`` folder of a source checkout (see ``[tool.setuptools.package-dir]`` in
pyproject.toml), so an installed wheel finds them too. Run dirs, data and checkpoints
go under the current directory (``paths.root_dir``), exactly as with ``python train.py``.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import os
import sys
from collections.abc import Callable
from functools import wraps
from types import ModuleType
from typing import Any

import hydra
from hydra.core.plugins import Plugins
from omegaconf import DictConfig

from hydra_plugins.vit_mnist_study import StudySweeper
from vit_mnist import errors
from vit_mnist.errors import USER_ERRORS, exit_on_user_error, multirun_job_dir, stops_in_one_line
from vit_mnist.hydra_errors import hydra_error_line, split_overrides

CONFIG_PATH = "pkg://vit_mnist.configs"

# The interpreter's last garbage collection at exit walks every object that torch and
# Lightning made at import: 1.3 s of a 1.6 s exit on a 2-core CPU, after the program has
# finished and every file it writes is closed. Frozen, they are left to the process's end.
atexit.register(gc.freeze)

_STARTED: list[str] = []  # the task whose body has begun (see _start)


def _command_line(main: Callable[[], Any]) -> Callable[[], Any]:
    """Wrap a ``@hydra.main`` function for the command line: Hydra's own errors before the
    task runs (an unknown key, a group option that does not exist, an override it cannot
    parse, a run dir it cannot create) become one line and exit status 2, with the fix;
    exit status 1 after a multirun in which a job failed (each wrote its ``failed.json``,
    :func:`vit_mnist.errors.exit_on_user_error`, and the others ran), whichever launcher
    ran the jobs; a user error raised by the sweeper itself (an Optuna study's
    ``optimized_metric``) is one line and exit status 2, as in a single run."""

    @wraps(main)
    def wrapper() -> Any:
        # Without it, Hydra prints its own errors over several lines and exits 1; with it,
        # they reach this wrapper. Set for this call only: processes started later (tests,
        # DDP's) read the user's own setting, and a user who set it gets Hydra's report.
        full_errors = os.environ.get("HYDRA_FULL_ERROR")
        os.environ["HYDRA_FULL_ERROR"] = "1"
        # Hydra finds plugins by listing the ``hydra_plugins`` package, which an editable
        # install (``pip install -e``) does not list: the Optuna study's sweeper, by name.
        Plugins.instance().register(StudySweeper)
        try:
            result = main()
        except Exception as e:
            line = str(e) if isinstance(e, USER_ERRORS) else None  # the sweeper's own check
            if line is None and not (full_errors or _STARTED):
                command = main.__name__  # its config: configs/<command>.yaml, eval for evaluate
                config_name = "eval" if command == "evaluate" else command
                line = hydra_error_line(e, command, config_name, sys.argv[1:])
            if line is None:
                raise
            print(f"error: {line}", file=sys.stderr)
            raise SystemExit(2) from None
        finally:
            if full_errors is None:
                del os.environ["HYDRA_FULL_ERROR"]
            else:
                os.environ["HYDRA_FULL_ERROR"] = full_errors

        if errors.FAILED_JOBS:  # read now: the sweep's callback (and a test) set it
            failed = [f"  {job_dir}: {message}" for job_dir, message in errors.FAILED_JOBS]
            print(f"{len(failed)} job(s) of the sweep failed:", *failed, sep="\n", file=sys.stderr)
            raise SystemExit(1)
        return result

    return wrapper


def _start(task: str, cfg: DictConfig) -> ModuleType:
    """Import ``vit_mnist.<task>`` (torch, Lightning: seconds) and quiet the console.

    Before the imports, outside a multirun, ``cfg``'s keys, types and ranges are checked
    against the task's schema (:data:`vit_mnist.settings.SETTINGS`), which needs neither: a
    bad value is one line (exit status 2) in about a second, not after them. The task then
    checks only what needs the imports (the values that passed are not checked again); in
    a multirun it alone checks, so that a bad job is recorded once and the sweep goes on.
    Ctrl-C during the imports ends the program with one line and status 130.
    """
    from hydra.core.hydra_config import HydraConfig

    from vit_mnist.settings import SETTINGS, check_settings

    _STARTED.append(task)
    if multirun_job_dir() is None:
        # The overrides as typed (quoting included), for the error line to echo them.
        typed = {k: v for p, k, v in split_overrides(HydraConfig.get().overrides.task) if p != "~"}
        exit_on_user_error(check_settings)(cfg, SETTINGS[task], targets=False, typed=typed)
    try:
        module = importlib.import_module(f"vit_mnist.tasks.{task}")
        from vit_mnist.console import quiet_console
    except KeyboardInterrupt:
        print("\nInterrupted while starting up: nothing was run or written.", file=sys.stderr)
        raise SystemExit(130) from None
    quiet_console()
    return module


@_command_line
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="train")
def train(cfg: DictConfig) -> dict[str, Any] | float | None:
    """``vit-mnist-train [overrides]`` = ``python train.py [overrides]``. Returns the run's
    metrics, or with ``optimized_metric`` set (a hyper-parameter search) that one value."""
    metrics = _start("train", cfg).main(cfg)
    name = cfg.get("optimized_metric")
    # The one number a sweeper optimises (configs/hparams_search/); None from a job stopped
    # by a user error (the sweep goes on), which the study records as a failed trial.
    return float(metrics[name]) if name and metrics is not None else metrics


@_command_line
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="eval")
def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """``vit-mnist-eval ckpt_path=PATH`` = ``python eval.py ckpt_path=PATH``."""
    return stops_in_one_line(_start("evaluate", cfg).main, cfg)


@_command_line
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="predict")
def predict(cfg: DictConfig) -> Any:
    """``vit-mnist-predict ckpt_path=PATH images=[a.png]`` = ``python scripts/predict.py ...``."""
    return _start("predict", cfg).main(cfg)


@_command_line
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="export")
def export(cfg: DictConfig) -> Any:
    """``vit-mnist-export ckpt_path=PATH format=onnx`` = ``python scripts/export.py ...``."""
    return stops_in_one_line(_start("export", cfg).main, cfg)


@_command_line
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="explore")
def explore(cfg: DictConfig) -> Any:
    """``vit-mnist-explore ckpt_path=PATH`` = ``python scripts/explore.py ckpt_path=PATH``."""
    return stops_in_one_line(_start("explore", cfg).main, cfg)
