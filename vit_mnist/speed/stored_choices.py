"""The speed choices this machine has measured, kept between runs in one small JSON file,
``<cache_root()>/speed_choices.json`` (``$VIT_MNIST_CACHE``, else the XDG cache folder), so
that a repeated run, a sweep's jobs and a study's trials reuse the choice instead of timing
the paths again (docs/speed.md, "How auto chooses").

A choice is filed under a key of everything that decides it (:func:`choice_key`): the CPU's
model and flags, the instruction-set class PyTorch runs at, the torch version, the device and
its thread count, the model's shape, the batch size, the precision setting and the
candidates. Each entry keeps, per candidate, one figure (images/s) per measurement, newest
last, and whether the choice is settled; an unsettled one has its leaders timed again by the
next run (:mod:`vit_mnist.speed.choose`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout

from vit_mnist.hardware import cpu_name, cpuinfo_flags, describe_device, isa_class
from vit_mnist.io import atomic_write_bytes
from vit_mnist.speed import cache_root

log = logging.getLogger(__name__)

FILE_NAME = "speed_choices.json"
# The file's layout; a file of another layout (an older or newer vit-mnist) is ignored.
LAYOUT = 1
# Figures kept per candidate: the median of the last few runs' measurements counts, so one
# run's lucky or unlucky timing does not decide alone.
KEEP_FIGURES = 5
# Model arguments that change neither the step's shapes nor its kernels: a sweep over them
# reuses the choice. Attention dropout is not among them: the attention kernel cannot run it.
_NOT_SHAPE = ("dropout", "drop_path_rate", "init_from")


def choice_key(
    device: torch.device, model_args: dict[str, Any], batch_size: int, precision: str, pairs
) -> dict[str, Any]:
    """What decides which path is fastest: the CPU (model name, a digest of its flags, the
    class PyTorch's kernels run at), torch's version, the device with its thread count
    (:func:`describe_device`), the model's shape arguments, ``batch_size`` (images), the
    ``precision`` setting as given (``auto`` or a forced one) and the candidate
    ``pairs`` ((path, precision) tuples)."""
    flags = " ".join(sorted(cpuinfo_flags()))
    return {
        "cpu": cpu_name(),
        "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "isa": isa_class(),
        "torch": torch.__version__,
        "device": describe_device(device),
        "model": {k: v for k, v in sorted(model_args.items()) if k not in _NOT_SHAPE},
        "batch_size": batch_size,
        "precision": precision,
        "candidates": [f"{p} {q}" for p, q in pairs],
    }


def _key_id(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]


@dataclass
class StoredChoice:
    """One key's measurements: ``figures`` (``"path precision"`` -> images/s, one per
    measurement, newest last, at most :data:`KEEP_FIGURES`), the ``measured_on`` date of the
    first (ISO), ``settled`` (False: the next run times the leaders again) and ``retimes``
    (how often the leaders were timed again since it was last unsettled)."""

    key: dict[str, Any] | None
    figures: dict[str, list[float]] = field(default_factory=dict)
    measured_on: str = field(default_factory=lambda: datetime.date.today().isoformat())
    settled: bool = False
    retimes: int = 0

    def medians(self) -> dict[str, float]:
        """``"path precision"`` -> the median of its figures (images/s)."""
        return {k: statistics.median(v) for k, v in self.figures.items() if v}

    def best(self) -> str:
        """The ``"path precision"`` with the highest median figure."""
        medians = self.medians()
        return max(medians, key=medians.get)

    def add(self, figures: dict[str, float]) -> None:
        """Append one measurement's figures (images/s) to each candidate's list."""
        for name, value in figures.items():
            kept = self.figures.setdefault(name, [])
            kept.append(round(float(value), 1))
            del kept[:-KEEP_FIGURES]


def store_path() -> Path:
    """``<cache_root()>/speed_choices.json``."""
    return cache_root() / FILE_NAME


def _entries(path: Path, warn: bool = True) -> dict[str, Any]:
    """The file's entries by key id; {} for a damaged or foreign file, with one warning
    where ``warn`` (the reader warns; the writer then replaces the file quietly)."""
    why = None
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except OSError as e:
        data, why = None, e.strerror or str(e)
    except ValueError:
        data, why = None, "not a JSON file"
    if why is None and (not isinstance(data, dict) or data.get("layout") != LAYOUT):
        why = f"not a speed-choice file of layout {LAYOUT} (another program's or version's)"
    if why is None:
        entries = data.get("choices")
        return entries if isinstance(entries, dict) else {}
    if warn:
        log.warning("ignoring %s: %s; the speed paths are measured again", path, why)
    return {}


def read_choice(key: dict[str, Any]) -> StoredChoice | None:
    """The stored choice for ``key``, or None: none stored, or a damaged entry (warned)."""
    path = store_path()
    raw = _entries(path).get(_key_id(key))
    if raw is None:
        return None
    try:
        # Keys of another version's entries are left out, not taken for damage.
        entry = StoredChoice(**{f.name: raw[f.name] for f in fields(StoredChoice) if f.name in raw})
        figures_ok = all(
            isinstance(v, list) and v and all(isinstance(x, (int, float)) and x > 0 for x in v)
            for v in entry.figures.values()
        )
        if entry.key != json.loads(json.dumps(key, default=str)) or not figures_ok:
            raise ValueError("its key or figures do not match")
        return entry if entry.figures else None
    except (TypeError, ValueError) as e:
        log.warning("ignoring a damaged entry in %s (%s); measuring again", path, e)
        return None


def write_choice(entry: StoredChoice) -> bool:
    """Store ``entry`` under its key, keeping every other key's; False where it could not.
    The read, change and write hold a lock file (``speed_choices.json.lock``), and the file
    is replaced whole (:func:`~vit_mnist.io.atomic_write_bytes`): two sweep jobs writing at
    once leave a readable file holding both. A folder that cannot be written costs the next
    run a measurement, not this run: one warning, no error."""
    path = store_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock", timeout=10):
            entries = _entries(path, warn=False)
            entries[_key_id(entry.key)] = json.loads(json.dumps(asdict(entry), default=str))
            data = {"layout": LAYOUT, "choices": entries}
            atomic_write_bytes(path, json.dumps(data, indent=1, sort_keys=True).encode())
        return True
    except (OSError, Timeout) as e:
        why = f"could not store the speed choice in {path} ({e})"
        log.warning("%s; the next run measures again", why)
        return False
