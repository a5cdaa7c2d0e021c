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
import importlib.resources
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
CONFIG_NAMES = {"train": "train", "evaluate": "eval", "predict": "predict", "export": "export"}
CONFIG_NAMES["explore"] = "explore"

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
        _register_plugins()
        try:
            result = main()
        except Exception as e:
            from vit_mnist.errors import USER_ERRORS

            told = not (full_errors or _STARTED)
            line = _hydra_error_line(e, main.__name__, sys.argv[1:]) if told else None
            if isinstance(e, USER_ERRORS):  # the sweeper's own check (hparams_search=...)
                line = str(e)
            if line is None:
                raise
            print(f"error: {line}", file=sys.stderr)
            raise SystemExit(2) from None
        finally:
            if full_errors is None:
                os.environ.pop("HYDRA_FULL_ERROR")
            else:
                os.environ["HYDRA_FULL_ERROR"] = full_errors
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


def _hydra_error_line(error: Exception, command: str, argv: list[str]) -> str | None:
    """One line for an error Hydra raised while composing the config, before the task began;
    None for anything else. Told apart by type, the attributes Hydra gives its errors and
    what the project itself checks, never by the wording of the message."""
    from hydra.errors import (
        ConfigCompositionException,
        HydraException,
        MissingConfigException,
        OverrideParseException,
    )
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, OverrideParseException):
        return (
            f"cannot read the override {error.override} (quote lists and values with spaces: "
            "'model.num_heads=[2,4]'; grammar: "
            "https://hydra.cc/docs/advanced/override_grammar/basic/)"
        )
    if isinstance(error, MissingConfigException):
        if error.missing_cfg_file is None:  # no configs/: the project is not installed
            return f"{text} Install the project first: pip install -e . (the quick start)"
        group, _, option = error.missing_cfg_file.rpartition("/")
        if group and error.options is not None:
            return (
                f"{group}={option} is not an option of {group}; choose one of "
                f"{list(error.options)} (the files in configs/{group}/)"
            )
        return text
    if isinstance(error, ConfigCompositionException):
        cause = error.__cause__
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
            return _unknown_override(cause.full_key, argv, command)
        key = _added_but_set(command, argv) if cause is None else None
        if key is not None:
            value = _given(key, argv)
            return (
                f"{key} is a setting already: drop the + ({key}={value}), or write ++ to "
                f"set a key whether or not it exists (++{key}={value})"
            )
        return text
    if isinstance(error, OSError) and error.filename:
        return (
            f"cannot create the run dir {error.filename}: {error.strerror}; choose a folder "
            "you can write with hydra.run.dir=PATH (or hydra.sweep.dir=PATH with -m)"
        )
    if isinstance(error, HydraException):
        return text
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


def _overrides(argv: list[str]) -> list[tuple[str, str, str]]:
    """``(prefix, key, value)`` of each ``key=value`` override (prefix ``+``, ``++``, ``~``
    or empty)."""
    found = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        key = name.lstrip("+~")
        if eq:
            found.append((name[: len(name) - len(key)], key, value))
    return found


def _given(key: str, argv: list[str]) -> str | None:
    """The value that the command line gives ``key`` (``key=v``, ``+key=v``, ``++key=v``)."""
    return next((v for _, k, v in _overrides(argv) if k == key), None)


def _added_but_set(command: str, argv: list[str]) -> str | None:
    """The first ``+key=value`` whose key the config sets already: the config composed
    again without the ``+`` overrides has it. None when there is none, or when the config
    does not compose without them either."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    added = [k for p, k, _ in _overrides(argv) if p == "+"]
    plain = [a for a in argv if not (a.startswith("+") and not a.startswith("++"))]
    if not added:
        return None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module("vit_mnist.configs", version_base="1.3"):
            cfg = compose(CONFIG_NAMES[command], overrides=plain)
    except Exception:  # noqa: BLE001 - another error: passed on as Hydra wrote it
        return None
    finally:
        GlobalHydra.instance().clear()
    absent = object()
    return next((k for k in added if OmegaConf.select(cfg, k, default=absent) is not absent), None)


def _group_set_to_null(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(group, its options)`` of the first ``group=null`` (or ``+group=null``), a group
    being a folder of ``configs/`` (options: its YAML files) or a path such as
    ``hydra/launcher`` (options not listed: Hydra's plugins add some); None without one."""
    configs = importlib.resources.files("vit_mnist.configs")
    for prefix, key, value in _overrides(argv):
        if value.lower() != "null" or "~" in prefix:
            continue
        if "/" in key:
            return key, []
        if configs.joinpath(key).is_dir():
            options = configs.joinpath(key).iterdir()
            return key, sorted(f.name[:-5] for f in options if f.name.endswith(".yaml"))
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
        under = (f"{k}={v}" for _, k, v in _overrides(argv) if k.startswith(f"{key}."))
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
    Ctrl-C during the imports ends the program with one line and status 130.
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
    file is written whole, :mod:`vit_mnist.io`), exit status 130 or 143."""

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
        print(
            f"\nStopped by {what} during {Path(sys.argv[0]).name}; {done} was written.",
            file=sys.stderr,
        )
        raise SystemExit(128 + e.signum) from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@_command_line
@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="train")
def train(cfg: DictConfig) -> dict[str, Any] | float | None:
    """``vit-mnist-train [overrides]`` = ``python train.py [overrides]``. Returns the run's
    metrics, or with ``optimized_metric`` set (a hyper-parameter search) that one value."""
    metrics = _start("train", cfg).main(cfg)
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
