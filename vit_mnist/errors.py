"""Errors that the command line reports as one line, without a traceback, and the
decorator that turns them into that line and exit status 2."""

from __future__ import annotations

import json
import logging
import signal
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from vit_mnist.io import WriteError, atomic_write_bytes

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A setting that cannot work, such as ``embed_dim`` not divisible by ``num_heads``; the
    message names the key, the value and what would be valid."""


class DataError(RuntimeError):
    """A data file that is missing, truncated or fails its checksum, and cannot be rebuilt;
    the message names the file and says how to fix it."""


class CheckpointError(RuntimeError):
    """A checkpoint path that is missing, unreadable or not a checkpoint of this project."""


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the message names the step and the LR."""


# Errors whose message is the whole story: the command line prints one line, exits 2.
# (WriteError is io's, the layer below, which writes every file.)
USER_ERRORS = (ConfigError, DataError, CheckpointError, NonFiniteLossError, WriteError)


# The jobs of this process's Hydra multirun that failed, as (run dir, message), read from
# their failed.json when the sweep ends (:class:`SweepFailures`): the command line exits 1
# after the sweep when any did.
FAILED_JOBS: list[tuple[str, str]] = []

FAILED_FILE = "failed.json"


def record_failure(job_dir: str | Path, message: str, kind: str) -> None:
    """Write ``<job_dir>/failed.json`` (``error``: ``message``, ``type``: ``kind``), the
    record of a sweep's job that failed, whichever process or machine ran it."""
    record = {"error": message, "type": kind}
    atomic_write_bytes(Path(job_dir) / FAILED_FILE, (json.dumps(record, indent=2) + "\n").encode())


class SweepFailures(Callback):
    """The Hydra callback (configs/hydra/default.yaml) that gathers a sweep's failed jobs
    from their ``failed.json`` once the sweep ends, into :data:`FAILED_JOBS`.

    Read from the files, not from this process's memory: Hydra's basic launcher runs the
    jobs in this process, but the joblib launcher runs them in worker processes and the
    SLURM one on other machines; each writes its record into its own run dir. A job that
    starts removes the record of an earlier sweep into the same folder.
    """

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:
            (Path(config.hydra.runtime.output_dir) / FAILED_FILE).unlink(missing_ok=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        for path in sorted(Path(config.hydra.sweep.dir).rglob(FAILED_FILE)):
            FAILED_JOBS.append((str(path.parent), json.loads(path.read_text())["error"]))


def multirun_job_dir() -> str | None:
    """The run dir of the current Hydra multirun job, or None outside a multirun."""
    if not HydraConfig.initialized():
        return None
    config = HydraConfig.get()
    return config.runtime.output_dir if config.mode == RunMode.MULTIRUN else None


def exit_on_user_error(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a :data:`USER_ERRORS` exception into one line on stderr and exit status 2.

    Inside a Hydra multirun (``-m``) the job does not exit: the line is printed, the
    error is written to ``<run dir>/failed.json`` (:func:`record_failure`), the job
    returns None, and the sweep goes on with its next job.

    Any other exception keeps its traceback: that is a bug to report, not bad input.
    """

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (*USER_ERRORS, InstantiationException) as e:
            # hydra.utils.instantiate wraps what a constructor raises: report the cause.
            cause = e.__cause__ if isinstance(e, InstantiationException) else e
            if not isinstance(cause, USER_ERRORS):
                raise
            # One line on stderr; logging it too would print it twice on the console.
            log.debug("user error", exc_info=True)
            # A non-finite loss stops training mid-epoch, where the progress bar's line has
            # no newline yet: start the error on a line of its own.
            fresh = "\n" if isinstance(cause, NonFiniteLossError) else ""
            job_dir = multirun_job_dir()
            if job_dir is None:
                print(f"{fresh}error: {cause}", file=sys.stderr)
                raise SystemExit(2) from None
            record_failure(job_dir, str(cause), type(cause).__name__)
            print(f"{fresh}error in job {job_dir}: {cause} (the sweep goes on)", file=sys.stderr)
            return None

    return wrapper


class Stopped(BaseException):
    """Ctrl-C or SIGTERM, raised by :func:`stops_in_one_line`'s handler. Not a
    ``KeyboardInterrupt``: Lightning turns that into exit status 1 and Gradio's server loop
    swallows it; this passes through both (each cleans up on the way) to one line. Its one
    argument is the signal's number."""


def stops_in_one_line(body: Callable[[DictConfig], Any], cfg: DictConfig) -> Any:
    """``body(cfg)`` (eval.py's, export.py's or explore.py's main); Ctrl-C or SIGTERM at any
    stage ends the program with one line saying which files of the run dir are complete
    (every file is written whole, :mod:`vit_mnist.io`), exit status 130 or 143."""

    def stop(signum: int, frame: Any) -> None:
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return body(cfg)
    except Stopped as e:
        (signum,) = e.args
        what = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        out = cfg.paths.output_dir
        files = (p for p in Path(out).glob("*") if p.is_file() and p.suffix != ".log")
        made = sorted(p.name for p in files if not p.name.startswith("."))
        done = f"complete in {out}: {', '.join(made)}; nothing else" if made else "no file"
        script = Path(sys.argv[0]).name
        print(f"\nStopped by {what} during {script}; {done} was written.", file=sys.stderr)
        raise SystemExit(128 + signum) from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
