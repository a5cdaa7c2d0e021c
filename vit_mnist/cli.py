"""Command-line entry points: ``python train.py`` and the console script ``vit-mnist-train``
are the same function, and so on for eval, predict and export.

The configs are read from the package ``vit_mnist.configs``, which is the top-level
``configs/`` folder of a source checkout (see ``[tool.setuptools.package-dir]`` in
pyproject.toml), so an installed wheel finds them too. Run dirs, data and checkpoints
go under the current directory (``paths.root_dir``), exactly as with ``python train.py``.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import importlib.resources
import logging
import os
import signal
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from types import ModuleType
from typing import Any

import hydra
from omegaconf import DictConfig

CONFIG_PATH = "pkg://vit_mnist.configs"
_ENV_AT_START = dict(os.environ)

# The interpreter's last garbage collection at exit walks every object that torch and
# Lightning made at import: 1.3 s of a 1.6 s exit on a 2-core CPU, after the program has
# finished and every file it writes is closed. Frozen, they are left to the process's end.
atexit.register(gc.freeze)


_STARTED: list[str] = []  # the task whose body has begun (see _start)


def _command_line(main: Callable[[], Any]) -> Callable[[], Any]:
    """Wrap a ``@hydra.main`` function for the command line.

    - Hydra's own errors before the task runs (an unknown key, a group option that does
      not exist, an override it cannot parse, a run dir it cannot create) become one line
      on stderr and exit status 2, with the fix: the nearest setting's name, or the right
      ``+``/``++`` form. Hydra prints them itself, over several lines, unless
      ``HYDRA_FULL_ERROR`` is set; it is set here so they reach this wrapper (a user who set
      it gets Hydra's full report as before).
    - Exit status 1 after a multirun in which a job failed (each such job wrote
      ``failed.json`` and the others ran: :func:`vit_mnist.errors.exit_on_user_error`,
      :class:`vit_mnist.errors.SweepFailures`), whichever launcher ran the jobs.
    - A user error raised by the sweeper itself (an Optuna study's ``optimized_metric``) is
      one line and exit status 2, as in a single run.
    - A stop by Ctrl-C or SIGTERM (130, 143) exits at once: see :func:`_exit_at_once`.
    """

    @wraps(main)
    def wrapper() -> Any:
        user_setting = os.environ.get("HYDRA_FULL_ERROR")
        user_wants_full_errors = bool(user_setting)
        os.environ["HYDRA_FULL_ERROR"] = "1"
        _register_plugins()
        try:
            result = main()
        except SystemExit as e:
            if e.code in STOPPED_BY_SIGNAL:
                _exit_at_once(e.code)
            raise
        except Exception as e:
            from vit_mnist.errors import USER_ERRORS

            line = None
            if isinstance(e, USER_ERRORS):  # the sweeper's own check (hparams_search=...)
                line = str(e)
            elif not user_wants_full_errors and not _STARTED:
                line = _hydra_error_line(e, main.__name__, sys.argv[1:])
            if line is None:
                raise
            print(f"error: {line}", file=sys.stderr)
            raise SystemExit(2) from None
        finally:
            # The user's own setting again for what runs after this call in this process
            # (another entry point, a test) and the processes started after it.
            if user_setting is None:
                os.environ.pop("HYDRA_FULL_ERROR", None)
            else:
                os.environ["HYDRA_FULL_ERROR"] = user_setting
        from vit_mnist.errors import FAILED_JOBS

        if FAILED_JOBS:
            print(f"{len(FAILED_JOBS)} job(s) of the sweep failed:", file=sys.stderr)
            for job_dir, message in FAILED_JOBS:
                print(f"  {job_dir}: {message}", file=sys.stderr)
            raise SystemExit(1)
        return result

    return wrapper


def _register_plugins() -> None:
    """Register this project's Hydra plugin, the Optuna study's sweeper
    (hydra_plugins/vit_mnist_study), by name: Hydra finds plugins by listing the
    ``hydra_plugins`` package, which an editable install (``pip install -e``) does not list."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.vit_mnist_study import StudySweeper

    Plugins.instance().register(StudySweeper)


# The exit statuses of a stop by Ctrl-C or SIGTERM: 128 + the signal's number.
STOPPED_BY_SIGNAL = (128 + signal.SIGINT, 128 + signal.SIGTERM)


def _exit_at_once(code: int) -> None:
    """Exit with ``code`` without the interpreter's teardown of torch and Lightning (1.3 s
    on a 2-core CPU, most of the time from a signal to the exit).

    Called once the stop has unwound the whole program: every ``finally`` and ``with`` has
    run, Lightning has closed its loggers, each file is written whole and the stop has been
    said. Only the log handlers and the console still hold text; they are flushed here.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


# The start of Hydra's message for ``+key=value`` on a key the config has already; it has no
# type of its own (a ConfigCompositionException without a cause). tests/test_cli.py pins it
# against the installed Hydra, so that a rewording fails there.
APPEND_EXISTING = "Could not append to config. An item is already at '{key}'."


def _given(key: str, argv: list[str]) -> str | None:
    """The value that the command line gives ``key`` (``key=v``, ``+key=v``, ``++key=v``)."""
    for arg in argv:
        name, eq, value = arg.lstrip("+~").partition("=")
        if eq and name == key:
            return value
    return None


def _hydra_error_line(error: Exception, command: str, argv: list[str]) -> str | None:
    """One line for an error Hydra raised while composing the config, before the task began;
    None for anything else. Recognised by type (and the attributes Hydra gives its
    errors), not by the wording of the message, except where noted."""
    from hydra.errors import (
        ConfigCompositionException,
        HydraException,
        MissingConfigException,
        OverrideParseException,
    )
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    if isinstance(error, OverrideParseException):
        return (
            f"cannot read the override {error.override}: {error.message.splitlines()[0]} "
            "(quote lists and values with spaces: 'model.num_heads=[2,4]'; grammar: "
            "https://hydra.cc/docs/advanced/override_grammar/basic/)"
        )
    if isinstance(error, MissingConfigException):
        if error.missing_cfg_file is None:
            # No primary config at all: configs/ is the package vit_mnist.configs only once
            # the project is installed.
            return (
                f"{first} Install the project first: pip install -e . in the checkout "
                "(the README's quick start)"
            )
        group, _, option = error.missing_cfg_file.rpartition("/")
        if group and error.options is not None:
            return (
                f"{group}={option} is not an option of {group}; choose one of "
                f"{list(error.options)} (the files in configs/{group}/)"
            )
        return first
    if isinstance(error, ConfigCompositionException):
        cause = error.__cause__
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
            return _unknown_override(cause.full_key, argv, command)
        for arg in argv:
            key, _, value = arg[1:].partition("=")
            if (
                arg.startswith("+")
                and not arg.startswith("++")
                and text.startswith(APPEND_EXISTING.format(key=key))
            ):
                return (
                    f"{key} is a setting already: drop the + ({key}={value}), or write ++ to "
                    f"set a key whether or not it exists (++{key}={value})"
                )
        return " ".join(text.split())
    if isinstance(error, OSError) and error.filename:
        return (
            f"cannot create the run dir {error.filename}: {error.strerror}; choose a folder "
            "you can write with hydra.run.dir=PATH (or hydra.sweep.dir=PATH with -m)"
        )
    if isinstance(error, HydraException):
        return " ".join(text.split())
    nulled = _group_set_to_null(argv)
    if isinstance(error, ValueError) and nulled is not None:
        # Hydra refuses `group=null` with a bare ValueError, before its own error types.
        key, options = nulled
        choose = f", or choose one of {options} ({key}=NAME)" if options else ""
        return (
            f"{key}=null: a config group cannot be set to null on the command line; leave "
            f"the group out with ~{key}{choose}"
        )
    return None


def _group_set_to_null(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(group, its options)`` of the first ``group=null`` (or ``+group=null``) in ``argv``,
    a group being a folder of ``configs/`` (options: its YAML files) or a path such as
    ``hydra/launcher`` (options not listed: Hydra's plugins add some); None when there is none."""
    configs = importlib.resources.files("vit_mnist.configs")
    for arg in argv:
        key, eq, value = arg.lstrip("+").partition("=")
        if not eq or value.lower() != "null" or arg.startswith("~"):
            continue
        if "/" in key:  # its options may come from Hydra's plugins too
            return key, []
        folder = configs.joinpath(key)
        if folder.is_dir():
            return key, sorted(f.name[:-5] for f in folder.iterdir() if f.name.endswith(".yaml"))
    return None


def _unknown_override(key: str, argv: list[str], command: str) -> str:
    """``model.num_head=4``: the nearest setting, or how to add an argument with ``+``."""
    from vit_mnist.settings import RETIRED, SETTINGS, known_keys, unknown_key

    schema = SETTINGS[command]
    value = _given(key, argv)
    section, _, name = key.rpartition(".")
    if key not in RETIRED and name in known_keys(schema, section):
        # A setting that this config's YAML leaves out, or a null section (eval.py's data)
        # under which a key was given (data.batch_size=512).
        under = (a.lstrip("+") for a in argv if a.lstrip("+").startswith(f"{key}."))
        arg = f"{key}={value}" if value is not None else next(under, f"{key}=...")
        return f"{key} is not set by this config; add it with a +: +{arg}"
    return unknown_key(key, schema, "..." if value is None else value)


def _start(task: str, cfg: DictConfig, command: str | None = None) -> ModuleType:
    """Import ``vit_mnist.<task>`` (torch, Lightning: seconds) and quiet the console.

    Before the imports, outside a multirun, ``cfg``'s keys, types and ranges are checked
    against the schema of ``command`` (a key of :data:`vit_mnist.settings.SETTINGS`;
    ``task`` by default), which needs neither: a bad value is one line (exit status 2) in
    about a second, not after them. The task checks again with what needs the imports; in
    a multirun it alone does, so that a bad job is recorded once and the sweep goes on.
    Ctrl-C during the imports ends the program with one line and status 130 (128 +
    SIGINT), not a traceback through the importers: nothing has been run or written yet.
    """
    from vit_mnist.errors import exit_on_user_error, multirun_job_dir
    from vit_mnist.settings import SETTINGS, check_settings

    _STARTED.append(task)
    if multirun_job_dir() is None:
        exit_on_user_error(check_settings)(cfg, SETTINGS[command or task], targets=False)
    try:
        module = importlib.import_module(f"vit_mnist.{task}")
        from vit_mnist.console import quiet_console
    except KeyboardInterrupt:
        print("\nInterrupted while starting up: nothing was run or written.", file=sys.stderr)
        raise SystemExit(130) from None
    quiet_console()
    return module


class _Stopped(BaseException):
    """Ctrl-C or SIGTERM, raised by :func:`_stops_in_one_line`'s handler. Not a
    ``KeyboardInterrupt``: Lightning turns that into exit status 1 and Gradio's server loop
    swallows it; this passes through both (each cleans up on the way) to one line."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stops_in_one_line(body: Callable[[DictConfig], Any], cfg: DictConfig) -> Any:
    """``body(cfg)`` (eval.py's, export.py's or explore.py's); Ctrl-C or SIGTERM at any stage
    ends the program with one line saying which files of the run dir are complete (every
    file is written whole, :mod:`vit_mnist.io`), exit status 130 or 143. Before, Ctrl-C in
    eval.py's figures was a 75-line traceback with no word that the run was incomplete."""

    def stop(signum: int, frame: Any) -> None:
        raise _Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return body(cfg)
    except _Stopped as e:
        what = "Ctrl-C" if e.signum == signal.SIGINT else "SIGTERM"
        out = cfg.paths.output_dir
        made = sorted(
            p.name
            for p in Path(out).glob("*")
            if p.is_file() and not p.name.startswith(".") and p.suffix != ".log"
        )
        done = f"complete in {out}: {', '.join(made)}; nothing else" if made else "no file"
        done += " was written"
        print(f"\nStopped by {what} during {Path(sys.argv[0]).name}; {done}.", file=sys.stderr)
        raise SystemExit(128 + e.signum) from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


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
    import torch
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
    from omegaconf import open_dict, read_write

    from vit_mnist.hardware import uses_cuda

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


@_command_line
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="train")
def train(cfg: DictConfig) -> dict[str, Any] | float | None:
    """``vit-mnist-train [overrides]`` = ``python train.py [overrides]``. Returns the run's
    metrics, or with ``optimized_metric`` set (a hyper-parameter search) that one value."""
    task = _start("train", cfg)
    prepare_ddp_launch(cfg.trainer)
    metrics = task.main(cfg)
    name = cfg.get("optimized_metric")
    if not name:
        return metrics
    # The one number a sweeper optimises (configs/hparams_search/); None from a job stopped
    # by a user error (the sweep goes on), which the study records as a failed trial.
    return None if metrics is None else float(metrics[name])


@_command_line
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="eval")
def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """``vit-mnist-eval ckpt_path=PATH`` = ``python eval.py ckpt_path=PATH``."""
    return _stops_in_one_line(_start("evaluate", cfg).main, cfg)


@_command_line
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="predict")
def predict(cfg: DictConfig) -> Any:
    """``vit-mnist-predict ckpt_path=PATH images=[a.png]`` = ``python scripts/predict.py ...``."""
    return _start("predict", cfg).main(cfg)


@_command_line
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="export")
def export(cfg: DictConfig) -> Any:
    """``vit-mnist-export ckpt_path=PATH format=onnx`` = ``python scripts/export.py ...``."""
    return _stops_in_one_line(_start("export", cfg).main, cfg)


@_command_line
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="explore")
def explore(cfg: DictConfig) -> Any:
    """``vit-mnist-explore ckpt_path=PATH`` = ``python scripts/explore.py ckpt_path=PATH``."""
    return _stops_in_one_line(_start("explorer", cfg, "explore").main, cfg)
