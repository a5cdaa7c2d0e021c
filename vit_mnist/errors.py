"""Errors that the command line reports as one line, without a traceback, and the
decorator that turns them into that line and exit status 2."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A setting that cannot work, such as ``embed_dim`` not divisible by ``num_heads``.

    The message names the key, the value and what would be valid.
    """


class DataError(RuntimeError):
    """A data file that is missing, truncated or fails its checksum, and cannot be rebuilt.

    The message names the file and says how to fix it.
    """


class CheckpointError(RuntimeError):
    """A checkpoint path that is missing, unreadable or not a checkpoint of this project."""


class WriteError(OSError):
    """A file that cannot be written (full disk, no permission); the message names it and
    says that the previous file, if there was one, is kept."""


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the message names the step and the LR."""


# Errors whose message is the whole story: the command line prints one line, exits 2.
USER_ERRORS = (ConfigError, DataError, CheckpointError, NonFiniteLossError, WriteError)


# The jobs of this process's Hydra multirun that stopped on a user error, as
# (run dir, message): the command line exits 1 after the sweep when any did.
FAILED_JOBS: list[tuple[str, str]] = []

FAILED_FILE = "failed.json"


def multirun_job_dir() -> str | None:
    """The run dir of the current Hydra multirun job, or None outside a multirun."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    config = HydraConfig.get()
    return config.runtime.output_dir if config.mode == RunMode.MULTIRUN else None


def exit_on_user_error(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a :data:`USER_ERRORS` exception into one line on stderr and exit status 2.

    Inside a Hydra multirun (``-m``) the job does not exit: the line is printed, the
    error is written to ``<run dir>/failed.json`` (``error``, ``type``) and added to
    :data:`FAILED_JOBS`, and the sweep goes on with its next job.

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
            from vit_mnist.io import atomic_write_bytes

            record = {"error": str(cause), "type": type(cause).__name__}
            atomic_write_bytes(
                Path(job_dir) / FAILED_FILE, (json.dumps(record, indent=2) + "\n").encode()
            )
            FAILED_JOBS.append((job_dir, str(cause)))
            print(f"{fresh}error in job {job_dir}: {cause} (the sweep goes on)", file=sys.stderr)
            return None

    return wrapper
