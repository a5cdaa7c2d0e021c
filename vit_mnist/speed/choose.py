"""Choosing the training path and precision by measurement, on the user's own machine.

``speed.path=auto`` (and ``trainer.precision=auto``) time every available candidate for a
few training steps on the real device, model shape and batch size, keep the fastest, and
remember the answer in ``$VIT_MNIST_CACHE/speed_choices.json`` (default
``~/.cache/vit_mnist``), keyed by the CPU model and instruction-set flags (or the GPU's
name), the torch version, the model's arguments, the batch size and the candidates. A
later run with the same key starts at once.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vit_mnist.errors import ConfigError
from vit_mnist.models.vit import VisionTransformer
from vit_mnist.speed import cache_root
from vit_mnist.speed.hardware import describe_hardware, hardware_key, has_native_bf16
from vit_mnist.speed.paths import PATHS

log = logging.getLogger(__name__)

PRECISIONS = ("32-true", "bf16-mixed")


@dataclass
class Choice:
    """The path and precision a run trains with, and how they were chosen.

    Attributes:
        path: a key of :data:`~vit_mnist.speed.paths.PATHS`.
        precision: a Lightning precision, ``32-true`` or ``bf16-mixed`` when measured.
        images_per_s: ``"path precision" -> images/s`` for every candidate timed (empty
            when nothing was timed).
        seconds: wall seconds spent choosing (timing, or reading the cache).
        how: ``measured``, ``cached`` or ``forced``.
        skipped: ``path -> why`` for paths not available here.
    """

    path: str
    precision: str
    images_per_s: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    how: str = "forced"
    skipped: dict[str, str] = field(default_factory=dict)

    def describe(self, device: torch.device) -> str:
        """One log line: the choice, every figure, the hardware and the time it took."""
        figures = ", ".join(f"{k} {v:,.0f}" for k, v in self.images_per_s.items())
        line = f"speed path: {self.path}, precision {self.precision} ({self.how}"
        if self.how != "forced":
            line += f" in {self.seconds:.2f} s"
        line += f"; {describe_hardware(device)})"
        if figures:
            line += f"; images/s: {figures}"
        return line


def check_speed_path(path: Any) -> None:
    """Raise ConfigError naming ``speed.path`` unless it is ``auto`` or a path's name."""
    if path != "auto" and path not in PATHS:
        raise ConfigError(f"speed.path={path!r} is unknown; use auto or one of {list(PATHS)}")


def candidates(
    device: torch.device,
    path: str,
    precision: str,
    include_compiled: bool,
    net: VisionTransformer | None = None,
) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """The (path, precision) pairs to time, and ``path -> why`` for those left out.

    ``net``, when given, must be supported too (a model with pruned heads is not by every
    path, see :attr:`TrainingPath.unsupported`).

    Raises:
        ConfigError: a forced path that cannot run on ``device`` or ``net``, saying why.
    """
    check_speed_path(path)
    skipped = {}

    def unavailable(p) -> str | None:
        return p.unavailable(device) or (None if net is None else p.unsupported(net))

    if path == "auto":
        paths = []
        for name, p in PATHS.items():
            why = unavailable(p)
            if why is None and p.compiles and not include_compiled:
                why = "compiles first (set speed.auto_compile=true to time it too)"
            if why is None:
                paths.append(name)
            else:
                skipped[name] = why
    else:
        why = unavailable(PATHS[path])
        if why is not None:
            raise ConfigError(f"speed.path={path} cannot run here: {why}; use speed.path=auto")
        paths = [path]
    if precision == "auto":
        precisions = list(PRECISIONS) if has_native_bf16(device.type == "cuda") else ["32-true"]
    else:
        precisions = [precision]
    return [(p, q) for p in paths for q in precisions], skipped


def _cache_key(device, model_args, batch_size, pairs) -> str:
    text = json.dumps(
        [hardware_key(device), model_args, batch_size, pairs], sort_keys=True, default=str
    )
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _read_cache(file: Path) -> dict[str, Any]:
    try:
        entries = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}  # a damaged file: measure again


def _write_cache(file: Path, key: str, entry: dict[str, Any]) -> None:
    from vit_mnist.io import atomic_write_bytes

    entries = _read_cache(file)
    entries[key] = entry
    try:
        atomic_write_bytes(file, (json.dumps(entries, indent=1, sort_keys=True) + "\n").encode())
    except OSError as e:  # a read-only home: the choice still holds for this run
        log.warning("speed choice not cached (%s)", e)


def time_candidates(
    net: VisionTransformer,
    pairs: list[tuple[str, str]],
    *,
    device: torch.device,
    batch_size: int,
    rounds: int = 3,
    steps: int = 2,
    budget_s: float = 6.0,
) -> dict[str, float]:
    """Median images/s of each (path, precision) over ``rounds`` interleaved rounds of
    ``steps`` training steps (forward, cross-entropy, backward, fused AdamW step).

    Runs on a copy of ``net`` with a random batch of ``batch_size`` images, and restores
    the random-number state, so the run that follows is the same as without it. Stops
    after the round in which ``budget_s`` seconds (after the warm-up) have passed: a model
    whose steps take seconds is timed over one round, not three.
    """
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    model = copy.deepcopy(net).to(device).train()
    embed = model.patch_embed
    shape = (batch_size, embed.proj.in_channels, embed.img_size, embed.img_size)
    images = torch.randn(shape, device=device)
    labels = torch.randint(0, model.head.out_features, (batch_size,), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type in ("cpu", "cuda"))
    forwards = {p: PATHS[p].build(model) for p in {p for p, _ in pairs}}

    def step(path: str, precision: str) -> None:
        bf16 = precision.startswith("bf16")
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(forwards[path](images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        for pair in pairs:
            step(*pair)  # warm-up: allocations, kernel builds, oneDNN's first-call setup
        speeds: dict[tuple[str, str], list[float]] = {pair: [] for pair in pairs}
        start = time.perf_counter()
        for _ in range(rounds):
            for pair in pairs:
                sync()
                t0 = time.perf_counter()
                for _ in range(steps):
                    step(*pair)
                sync()
                speeds[pair].append(steps * batch_size / (time.perf_counter() - t0))
            if time.perf_counter() - start > budget_s:
                break
    finally:
        torch.set_rng_state(rng)
        if cuda_rng:
            torch.cuda.set_rng_state_all(cuda_rng)
    return {f"{p} {q}": statistics.median(v) for (p, q), v in speeds.items()}


def choose(
    net: VisionTransformer,
    *,
    model_args: dict[str, Any],
    device: torch.device,
    batch_size: int,
    path: str = "auto",
    precision: str = "auto",
    include_compiled: bool = False,
    use_cache: bool = True,
) -> Choice:
    """The path and precision to train ``net`` with on ``device``.

    Args:
        net: the model (not modified: the timing runs on a copy).
        model_args: the model's constructor arguments (part of the cache key).
        device: where training runs.
        batch_size: images per training step.
        path: ``auto`` or a path's name (forced).
        precision: ``auto`` (bf16-mixed only where the hardware computes bf16 and it
            measures faster) or a Lightning precision (forced).
        include_compiled: let ``auto`` time the ``compile`` path too (it compiles first,
            10-60 s on a 2-core CPU without inductor's cache).
        use_cache: read and write the on-disk cache of earlier choices.

    Raises:
        ConfigError: an unknown path, or a forced one that cannot run here.
    """
    start = time.perf_counter()
    pairs, skipped = candidates(device, path, precision, include_compiled, net)
    if len(pairs) == 1:
        return Choice(*pairs[0], skipped=skipped)
    file = cache_root() / "speed_choices.json"
    key = _cache_key(device, model_args, batch_size, pairs)
    entry = _read_cache(file).get(key) if use_cache else None
    if (
        isinstance(entry, dict)
        and [entry.get("path"), entry.get("precision")] in [list(p) for p in pairs]
        and isinstance(entry.get("images_per_s"), dict)
    ):
        return Choice(
            entry["path"],
            entry["precision"],
            entry["images_per_s"],
            time.perf_counter() - start,
            "cached",
            skipped,
        )
    timed = pairs
    if all(PATHS[p].compiles for p, _ in pairs):
        # Timing a compiled path means compiling it once per candidate: the precision of a
        # forced compiled path is chosen on the handwritten eager path instead.
        timed = [("handwritten", q) for _, q in pairs]
    speeds = time_candidates(net, timed, device=device, batch_size=batch_size)
    best = max(speeds, key=speeds.get)
    best_precision = best.split(" ")[1]
    best_path = best.split(" ")[0] if timed is pairs else pairs[0][0]
    choice = Choice(
        best_path, best_precision, speeds, time.perf_counter() - start, "measured", skipped
    )
    if use_cache:
        entry = {"path": best_path, "precision": best_precision, "images_per_s": speeds}
        _write_cache(file, key, {**entry, "hardware": hardware_key(device)})
    return choice
