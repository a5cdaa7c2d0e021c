"""Choosing the training path and precision by measurement, on the user's own machine.

``speed.path=auto`` (and ``trainer.precision=auto``) time every available (path,
precision) candidate for a few training steps, in turn and interleaved, keep the fastest,
and remember the figures in ``$VIT_MNIST_CACHE/speed_choices.json`` (default
``~/.cache/vit_mnist``), keyed by the hardware (:func:`hardware_key`), the model's
arguments, the batch size and the candidates. A later run with the same key starts at once;
an entry it cannot read is measured again.

The compiled path (``compile``) is timed only with
``speed.compile=true``, because a model's first compile costs 30 to 60 s on a 2-core CPU;
it is then timed at the precision the eager paths chose, against the eager winner.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from vit_mnist.errors import ConfigError
from vit_mnist.models.vit import VisionTransformer
from vit_mnist.speed import cache_root
from vit_mnist.speed.hardware import describe_hardware, hardware_key, has_native_bf16, uses_cuda
from vit_mnist.speed.paths import PATHS

log = logging.getLogger(__name__)

PRECISIONS = ("32-true", "bf16-mixed")
Pair = tuple[str, str]  # (path, precision)


def _name(pair: Pair) -> str:
    return f"{pair[0]} {pair[1]}"


@dataclass
class Choice:
    """The path and precision a run trains with, and how they were chosen.

    Attributes:
        path: a key of :data:`~vit_mnist.speed.paths.PATHS`.
        precision: a Lightning precision, ``32-true`` or ``bf16-mixed`` when measured.
        images_per_s: ``"path precision" -> images/s`` of every candidate timed (or read
            from the cache); empty when nothing was timed.
        seconds: wall seconds spent choosing (timing, or reading the cache).
        how: ``measured``, ``cached`` or ``forced``.
        skipped: ``path -> why`` for the paths not timed.
    """

    path: str
    precision: str
    images_per_s: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    how: str = "forced"
    skipped: dict[str, str] = field(default_factory=dict)

    def describe(self, device: torch.device) -> str:
        """One log line: the choice, how long it took, every figure, what was left out."""
        line = f"speed path: {self.path}, precision {self.precision} ({self.how}"
        if self.how != "forced":
            line += f" in {self.seconds:.2f} s"
        line += f"; {describe_hardware(device)})"
        figures = ", ".join(f"{k} {v:,.0f}" for k, v in self.images_per_s.items())
        if figures:
            line += f"; images/s: {figures}"
        if self.how != "forced" and self.skipped:
            line += "; not timed: " + "; ".join(f"{p} ({why})" for p, why in self.skipped.items())
        return line

    def metrics(self) -> dict[str, Any]:
        """The choice's keys of ``metrics.json``: ``speed_path``, ``speed_choice`` (how),
        ``speed_choice_s`` (seconds, left out of the fitting time) and
        ``speed_images_per_s`` (the figures it was chosen on)."""
        return {
            "speed_path": self.path,
            "speed_choice": self.how,
            "speed_choice_s": round(self.seconds, 3),
            "speed_images_per_s": {k: round(v, 1) for k, v in self.images_per_s.items()},
        }


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
) -> tuple[list[Pair], dict[str, str]]:
    """The (path, precision) pairs ``choose`` may time, and ``path -> why`` for those left out.

    ``include_compiled=False`` leaves the compiled paths out of ``auto``. ``net``, when
    given, must be supported too (a model with pruned heads is not by every path, see
    :attr:`TrainingPath.unsupported <vit_mnist.speed.paths.TrainingPath>`).

    Raises:
        ConfigError: an unknown path, or a forced one that cannot run on ``device`` or
            ``net``, saying why.
    """
    check_speed_path(path)

    def unavailable(p) -> str | None:
        return p.unavailable(device) or (None if net is None else p.unsupported(net))

    paths, skipped = [], {}
    if path == "auto":
        for name, p in PATHS.items():
            why = unavailable(p)
            if why is None and p.compiles and not include_compiled:
                why = "compiles first, 30-60 s; speed.compile=true times it"
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


def _cache_file() -> Path:
    return cache_root() / "speed_choices.json"


def _cache_key(device: torch.device, model_args: dict, batch_size: int, pairs: list[Pair]) -> str:
    what = [hardware_key(device), model_args, batch_size, [list(p) for p in pairs]]
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _read_cache() -> dict[str, Any]:
    try:
        entries = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}  # a damaged file: start again


def _cached(key: str, pairs: list[Pair]) -> dict[str, float] | None:
    """The figures cached under ``key`` if they cover ``pairs``, each a positive number."""
    entry = _read_cache().get(key)
    figures = entry.get("images_per_s") if isinstance(entry, dict) else None
    if not isinstance(figures, dict):
        return None
    speeds = {_name(p): figures.get(_name(p)) for p in pairs}
    ok = all(type(v) in (int, float) and v > 0 for v in speeds.values())
    return {k: float(v) for k, v in speeds.items()} if ok else None


def _write_cache(key: str, device: torch.device, speeds: dict[str, float]) -> None:
    from vit_mnist.io import atomic_write_bytes

    entries = _read_cache()
    path, precision = max(speeds, key=speeds.get).split(" ")
    entries[key] = {
        "path": path,
        "precision": precision,
        "images_per_s": speeds,
        "hardware": hardware_key(device),
    }
    text = json.dumps(entries, indent=1, sort_keys=True) + "\n"
    try:
        atomic_write_bytes(_cache_file(), text.encode())
    except OSError as e:  # a read-only home: what was measured still holds for this run
        log.warning("%s not written (%s)", _cache_file().name, e)


def time_candidates(
    net: VisionTransformer,
    pairs: list[Pair],
    *,
    device: torch.device,
    batch_size: int,
    rounds: int = 5,
    steps: int = 2,
    min_round_s: float = 0.1,
    budget_s: float = 6.0,
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Images/s of each (path, precision) pair: ``"path precision" -> images/s``.

    A training step is what each step of the training loop pays: ``augment`` of a random
    batch of ``batch_size`` images (when given: the datamodule's batch augmentation), then
    forward, cross-entropy, backward and a fused AdamW step. Each pair first takes one
    untimed step (allocations, kernel builds; a compiled path compiles), then the pairs
    take turns for ``rounds`` rounds, in alternating order so a drift in the machine's
    speed hits all alike. A round is ``steps`` steps, or as many as fill ``min_round_s``
    (a GPU step of 15 ms is too short to time alone). A pair's figure is its best round:
    on a shared machine load only ever slows a round down (as :mod:`timeit` takes the
    minimum). The rounds stop early after the one in which ``budget_s`` seconds have passed.

    Runs on a copy of ``net`` and restores the random-number state, so the run that
    follows is the same as without it.
    """
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    model = copy.deepcopy(net).to(device).train()
    shape = (batch_size, model.in_chans, model.img_size, model.img_size)
    images = torch.randn(shape, device=device)
    labels = torch.randint(0, model.head.out_features, (batch_size,), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type in ("cpu", "cuda"))
    forwards = {p: PATHS[p].build(model) for p in {p for p, _ in pairs}}

    def timed_steps(pair: Pair, n: int) -> float:
        """Seconds per step over ``n`` steps of ``pair``."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(n):
            batch = images if augment is None else augment(images)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled="bf16" in pair[1]):
                loss = F.cross_entropy(forwards[pair[0]](batch), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) / n

    try:
        step_s = {pair: timed_steps(pair, 1) for pair in pairs}
        speeds = {pair: 0.0 for pair in pairs}
        start = time.perf_counter()
        for r in range(rounds):
            for pair in pairs if r % 2 == 0 else pairs[::-1]:
                n = max(steps, math.ceil(min_round_s / max(step_s[pair], 1e-6)))
                step_s[pair] = timed_steps(pair, n)
                speeds[pair] = max(speeds[pair], batch_size / step_s[pair])
            if time.perf_counter() - start > budget_s:
                break
    finally:
        torch.set_rng_state(rng)
        if cuda_rng:
            torch.cuda.set_rng_state_all(cuda_rng)
    return {_name(p): v for p, v in speeds.items()}


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
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Choice:
    """The path and precision to train ``net`` with on ``device``.

    Args:
        net: the model (not modified: the timing runs on a copy).
        model_args: the model's constructor arguments (part of the cache key).
        device: where training runs.
        batch_size: images per training step (per process).
        path: ``auto`` or a path's name (forced).
        precision: ``auto`` (bf16-mixed only where the hardware computes bf16 and it
            measures faster) or a Lightning precision (forced).
        include_compiled: whether ``auto`` also times the compiled paths, at the precision
            the eager paths chose.
        use_cache: read and write the cache of earlier figures.
        augment: the training batches' augmentation, timed with each step (see
            :func:`time_candidates`).

    Raises:
        ConfigError: an unknown path, or a forced one that cannot run here.
    """
    start = time.perf_counter()
    pairs, skipped = candidates(device, path, precision, include_compiled, net)
    if len(pairs) == 1:
        return Choice(*pairs[0], skipped=skipped)

    def figures(timed: list[Pair]) -> tuple[dict[str, float], str]:
        key = _cache_key(device, model_args, batch_size, timed)
        cached = _cached(key, timed) if use_cache else None
        if cached is not None:
            return cached, "cached"
        speeds = time_candidates(net, timed, device=device, batch_size=batch_size, augment=augment)
        if use_cache:
            _write_cache(key, device, speeds)
        return speeds, "measured"

    if all(PATHS[p].compiles for p, _ in pairs):
        # A forced compiled path with precision auto: the precision is chosen on the eager
        # path that stands for it, rather than compiling once per precision.
        stand_ins = [(PATHS[p].eager, q) for p, q in pairs]
        speeds, how = figures(stand_ins)
        best = max(speeds, key=speeds.get).split(" ")[1]
        return Choice(pairs[0][0], best, speeds, time.perf_counter() - start, how, skipped)
    eager = [p for p in pairs if not PATHS[p[0]].compiles]
    speeds, how = figures(eager)
    best = max(speeds, key=speeds.get)
    compiled = [p for p in pairs if PATHS[p[0]].compiles and p[1] == best.split(" ")[1]]
    if compiled:
        final, how_compiled = figures([*compiled, tuple(best.split(" "))])
        speeds.update(final)
        best = max(final, key=final.get)
        how = "measured" if "measured" in (how, how_compiled) else "cached"
    return Choice(*best.split(" "), speeds, time.perf_counter() - start, how, skipped)


def prepare_speed(module: Any, cfg: DictConfig, datamodule: Any = None) -> Choice:
    """Choose the training path and precision for the run ``cfg`` and put the path's
    forward into ``module.step_forward`` (a LightningModule whose network is ``module.net``).
    ``datamodule``'s batch augmentation (its ``augment``, when it has one) is timed with
    each step, as the training loop pays it.

    Reads ``speed.path``, ``speed.compile``, ``speed.cache``, ``trainer.accelerator``,
    ``trainer.precision``, ``trainer.strategy``, ``trainer.devices``, ``data.batch_size``
    and ``model``; logs the choice in one line. Under DDP on CPU each process first takes
    its share of the cores, as Lightning's launcher would at the start of fit.

    Raises:
        ConfigError: an unknown path, or a forced one that cannot run here.
    """
    speed = cfg.get("speed") or {}
    device = torch.device("cuda" if uses_cuda(str(cfg.trainer.get("accelerator"))) else "cpu")
    processes = cfg.trainer.get("devices")
    ddp = str(cfg.trainer.get("strategy", "auto")).startswith("ddp")
    if device.type == "cpu" and ddp and isinstance(processes, int) and processes > 1:
        # Lightning's DDP launcher gives each process its share of the cores when fit
        # starts, unless OMP_NUM_THREADS says otherwise; the steps are timed as they will run.
        if "OMP_NUM_THREADS" not in os.environ:
            affinity = getattr(os, "sched_getaffinity", None)  # not on macOS
            cores = len(affinity(0)) if affinity else os.cpu_count() or 1
            torch.set_num_threads(max(1, cores // processes))
    choice = choose(
        module.net,
        model_args=OmegaConf.to_container(cfg.model, resolve=True),
        device=device,
        batch_size=cfg.data.batch_size,
        path=speed.get("path", "auto"),
        precision=str(cfg.trainer.get("precision", "auto")),
        include_compiled=bool(speed.get("compile", False)),
        use_cache=bool(speed.get("cache", True)),
        augment=getattr(datamodule, "augment", None),
    )
    module.step_forward = PATHS[choice.path].build(module.net)
    # A path that this device offers but that cannot run this model here (its kernel did
    # not build, pruned heads) is a fallback the user should see before the progress bar.
    fallen = {
        name: why
        for name, why in choice.skipped.items()
        if PATHS[name].unavailable(device) is None and PATHS[name].unsupported(module.net)
    }
    if fallen:
        reasons = "; ".join(f"{name}: {why}" for name, why in fallen.items())
        log.warning("speed path %s runs: these cannot run here (%s)", choice.path, reasons)
    log.info(choice.describe(device))
    return choice
