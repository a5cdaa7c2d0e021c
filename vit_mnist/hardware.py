"""The machine a run is on: CPU model and instruction-set class, GPU name, and the device
and precision a run's settings resolve to there.

Run records, the results table and every speed figure name the hardware with these,
because no training path is fastest everywhere (docs/speed.md).
"""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch


@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (Linux); empty where there is none."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpuinfo_flags() -> frozenset[str]:
    """The CPU's feature flags (``avx2``, ``avx512f``, ...; ARM's ``Features``); empty where
    /proc/cpuinfo is missing."""
    info = _cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else ``platform.processor()``."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_class() -> str:
    """The x86 instruction-set class the CPU itself has, from its flags, whatever
    ``ATEN_CPU_CAPABILITY`` says: ``AMX``, ``AVX512-BF16``, ``AVX-512``, ``AVX2`` or
    ``default``."""
    flags = cpuinfo_flags()
    if {"amx_tile", "amx_bf16"} <= flags:
        return "AMX"
    if "avx512f" in flags:
        return "AVX512-BF16" if "avx512_bf16" in flags else "AVX-512"
    return "AVX2" if "avx2" in flags else "default"


def isa_class() -> str:
    """The instruction-set class PyTorch's CPU kernels run with here: one of
    :func:`cpu_class`'s names, or ``ARM`` (``ARM SVE`` where PyTorch uses SVE). Follows
    ``ATEN_CPU_CAPABILITY``: with ``avx2`` on an AVX-512 machine this says ``AVX2``, as
    PyTorch's kernels (and inductor's generated code) then use AVX2 only."""
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "SVE256", ...
    if platform.machine().lower() in ("arm64", "aarch64"):
        return "ARM SVE" if capability.startswith("SVE") else "ARM"
    return {"AVX512": cpu_class(), "AVX2": "AVX2"}.get(capability, "default")


def has_native_bf16(on_cuda: bool) -> bool:
    """Whether this machine computes in bfloat16 natively: a CUDA GPU from Ampere on, or a
    CPU of class AVX512-BF16 or AMX (oneDNN's bf16 matrix products run at 2 to 4 times the
    float32 rate there). Elsewhere bf16 is emulated, about 10x slower than float32 on a Zen 3
    (docs/speed.md). Follows ``ATEN_CPU_CAPABILITY`` like :func:`isa_class`."""
    if on_cuda:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return isa_class() in ("AVX512-BF16", "AMX")


def resolve_accelerator(accelerator: str) -> str:
    """A Lightning ``accelerator`` setting (``auto``, ``cpu``, ``gpu``, ``cuda``) as the
    device type it runs on here, ``cuda`` or ``cpu``: ``auto`` is ``cuda`` where there is a
    CUDA device, else ``cpu`` (Lightning's own ``auto`` would take an Apple GPU, where no
    speed path is timed)."""
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if accelerator == "gpu" else accelerator


def uses_cuda(accelerator: str) -> bool:
    """Whether a Lightning ``accelerator`` setting runs on CUDA on this machine."""
    return resolve_accelerator(accelerator) == "cuda"


def resolve_precision(precision: Any, on_cuda: bool) -> str:
    """``trainer.precision``, with ``auto`` made concrete: ``bf16-mixed`` where the hardware
    has bfloat16 (see :func:`has_native_bf16`), else ``32-true``."""
    if str(precision) == "auto":
        return "bf16-mixed" if has_native_bf16(on_cuda) else "32-true"
    return str(precision)


def describe_device(device: torch.device, processes: int = 1) -> str:
    """A human-readable device line: ``cpu (AMD EPYC, AVX512-BF16, 2 threads)`` (the CPU
    class as :func:`cpu_class` gives it), or with ``processes`` above 1 (DDP on one
    machine), ``cpu (AMD EPYC, AVX512-BF16, 2 processes x 1 thread)``; on CUDA
    ``cuda (NVIDIA H100 80GB HBM3)``, with ``2 x`` in front for two processes. Where
    ``ATEN_CPU_CAPABILITY`` holds PyTorch's kernels below the CPU's class, the line says so:
    ``cpu (AMD EPYC, AVX2 on AVX512-BF16, 2 threads)``."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return f"cuda ({name})" if processes == 1 else f"cuda ({processes} x {name})"
    threads = torch.get_num_threads()
    per_process = f"{threads} thread{'s' if threads != 1 else ''}"
    if processes > 1:
        per_process = f"{processes} processes x {per_process}"
    cls, running = cpu_class(), isa_class()
    if cls != "default" and running != cls:  # an x86 CPU run as a lower class
        cls = f"{running} on {cls}"
    return f"cpu ({cpu_name()}, {cls}, {per_process})"
