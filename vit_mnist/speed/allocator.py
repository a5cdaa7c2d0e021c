"""Whether the C library's ``malloc`` keeps the memory a training step frees.

A CPU training step allocates its activations and gradients afresh every step (PyTorch's
CPU allocator is ``malloc``), megabytes each, and frees them by the end of the backward.
glibc's ``malloc`` serves large blocks with ``mmap`` and hands freed memory at the top of
its heap back to the kernel once more than ``M_TRIM_THRESHOLD`` is free there (both
thresholds grow with the largest block freed, up to 32 MiB and 64 MiB). So every step
asks the kernel for the same memory again, and the kernel maps and zeroes it a 4 KiB page
at a time, a page fault each: on a 2-core VM, 14 500 faults and 29 ms of system time in a
243 ms step (docs/speed.md). ``retain`` sets ``M_MMAP_THRESHOLD`` to 256 MiB and
``M_TRIM_THRESHOLD`` to 1 GiB (``mallopt(3)``), so the freed blocks stay in the heap for
the next step: the process keeps the step's peak memory instead of returning it.

The setting is the whole process's (data-loader workers forked later inherit it), and
glibc has no way back to its own adaptive thresholds once one is set: :data:`CEILING`
sets them to where glibc's own would stop growing. Which is faster depends on the machine
(how dear a page fault is), so ``speed.allocator=auto`` measures it
(:func:`vit_mnist.speed.choose.choose`).
"""

from __future__ import annotations

import ctypes
import platform
from functools import cache

MODES = ("retain", "system")
M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
RETAIN = {M_MMAP_THRESHOLD: 256 << 20, M_TRIM_THRESHOLD: 1 << 30}
# glibc's adaptive thresholds at their ceiling (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, and
# twice it): the nearest fixed setting to glibc's own behaviour, for going back.
CEILING = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 64 << 20}

_state = {"mode": "system", "set": False}


@cache
def _libc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def unavailable() -> str | None:
    """Why ``retain`` cannot be set here (not Linux with glibc), or None where it can."""
    if _libc() is None:
        this = " ".join(filter(None, (platform.system(), platform.libc_ver()[0])))
        return f"needs Linux with glibc; this is {this or 'another system'}"
    return None


def _mallopt(settings: dict[int, int]) -> None:
    libc = _libc()
    for option, value in settings.items():
        if libc is None or libc.mallopt(option, value) != 1:
            raise OSError(f"mallopt({option}, {value}) failed")


def set_mode(mode: str) -> None:
    """Make ``malloc`` keep freed memory (``retain``) or not (``system``), process-wide.

    ``system`` leaves ``malloc`` untouched where nothing was set before in this process;
    after ``retain`` it sets :data:`CEILING` and returns the free memory at once.

    Raises:
        ValueError: a mode that is not in :data:`MODES`.
        OSError: ``retain`` where :func:`unavailable` says why not.
    """
    if mode not in MODES:
        raise ValueError(f"allocator mode {mode!r} is unknown; use one of {list(MODES)}")
    if mode == "retain":
        why = unavailable()
        if why:
            raise OSError(f"speed.allocator=retain cannot be set: {why}")
        _mallopt(RETAIN)
        _state["set"] = True
    elif _state["set"]:
        _mallopt(CEILING)
        _libc().malloc_trim(0)
    _state["mode"] = mode


def current_mode() -> str:
    """The mode :func:`set_mode` last set in this process (``system`` before any)."""
    return _state["mode"]
