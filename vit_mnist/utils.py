"""Small pieces shared by train and evaluate: metrics files, device names, error exits."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException

from vit_mnist.data.sources import atomic_write_bytes
from vit_mnist.errors import CheckpointError, ConfigError, DataError, NonFiniteLossError
from vit_mnist.speed.hardware import cpu_name, has_native_bf16

log = logging.getLogger(__name__)

# Errors whose message is the whole story: the command line prints one line, exits 2.
USER_ERRORS = (ConfigError, DataError, CheckpointError, NonFiniteLossError)


def write_metrics(path: str | Path, metrics: dict[str, Any]) -> dict[str, Any]:
    """Write ``metrics`` as indented JSON, atomically (temporary file + rename).

    Returns:
        The metrics as written: tensors turned into Python numbers, non-finite floats
        into strings (JSON has no NaN).
    """
    clean = {k: _plain(v) for k, v in metrics.items()}
    atomic_write_bytes(Path(path), (json.dumps(clean, indent=2, sort_keys=True) + "\n").encode())
    log.info("Metrics written to %s", path)
    return clean


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def uses_cuda(accelerator: str) -> bool:
    """Whether a Lightning ``accelerator`` setting runs on CUDA on this machine."""
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def resolve_precision(precision: Any, on_cuda: bool) -> str:
    """``trainer.precision``, with ``auto`` made concrete: ``bf16-mixed`` where the hardware
    has bfloat16 (see :func:`has_native_bf16`), else ``32-true``."""
    precision = str(precision)
    if precision != "auto":
        return precision
    return "bf16-mixed" if has_native_bf16(on_cuda) else "32-true"


def pin_to_cores(local_rank: int, local_world_size: int) -> list[int] | None:
    """Pin this process to its own slice of the machine's CPU cores.

    Local rank ``r`` of ``n`` processes gets the ``r``-th of ``n`` equal, contiguous slices
    of the cores (an odd core left over stays free). Why: with one single-threaded DDP
    process per core, the scheduler otherwise moves the processes and gloo's threads
    between the cores, and every step waits for the slower process. On the 2-core Zen 5 of
    docs/benchmarks.md, a plain 2-process DDP loop of the speedrun model trained at
    3 862 images/s pinned against 3 719 unpinned (mean of 3 runs each, 1.04x).

    Only a process that may run on every core is pinned: one whose cores someone already
    chose (``taskset``, a SLURM binding, a container's cpuset) is left as it is, since its
    sibling processes may have been given other cores.

    Returns the cores given to this process, or None where nothing was changed: a single
    process, fewer cores than processes, an already restricted process, or an OS without
    ``sched_setaffinity``.
    """
    if local_world_size < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // local_world_size
    if len(cores) != os.cpu_count() or share == 0 or not 0 <= local_rank < local_world_size:
        return None
    mine = cores[local_rank * share : (local_rank + 1) * share]
    os.sched_setaffinity(0, mine)
    return mine


def describe_device(device: torch.device, processes: int = 1) -> str:
    """A human-readable device line: ``cpu (AMD EPYC, 2 threads)``, or with ``processes``
    above 1 (DDP on one machine), ``cpu (AMD EPYC, 2 processes x 1 thread)``; on CUDA
    ``cuda (NVIDIA H100 80GB HBM3)``, with ``2 x`` in front for two processes."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return f"cuda ({name})" if processes == 1 else f"cuda ({processes} x {name})"
    threads = torch.get_num_threads()
    per_process = f"{threads} thread{'s' if threads != 1 else ''}"
    if processes == 1:
        return f"cpu ({cpu_name()}, {per_process})"
    return f"cpu ({cpu_name()}, {processes} processes x {per_process})"


def exit_on_user_error(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a :data:`USER_ERRORS` exception into one line on stderr and exit status 2.

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
            print(f"error: {cause}", file=sys.stderr)
            raise SystemExit(2) from None

    return wrapper
