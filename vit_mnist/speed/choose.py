"""Choosing the training path and precision by measurement, on the user's own machine.

``speed.path=auto`` (and ``trainer.precision=auto``) time the candidates for a few training
steps on the real device, model shape and batch size, keep the fastest, and remember the
answer in ``$VIT_MNIST_CACHE/speed_choices.json`` (default ``~/.cache/vit_mnist``), keyed
by the CPU model and instruction-set flags (or the GPU's name), the torch version, the
model's arguments, the batch size, the candidates and the ``malloc`` mode they were timed
under. A later run with the same key starts at once.

The compiled paths compile before their first step: in seconds where this machine has
compiled the model before (inductor keeps what it built on disk), in 30 to 60 s for a
model's first compile on a 2-core CPU. So with ``speed.auto_compile=auto`` they are timed
only once compiling them costs at most ``speed.compile_budget`` (5%) of the training time
this machine has spent on the model under ``auto``, this run included: a short first run
starts at once on the fastest eager path; a long run, or a run after enough short ones,
pays the first compile once, and from then on every run compares the compiled paths too,
for seconds. What was compiled here, how long it took and how long each model trained is
kept in ``$VIT_MNIST_CACHE/compile_times.json``.

On a CPU with glibc, ``speed.allocator=auto`` first times whether ``malloc`` keeping the
memory a step frees (:mod:`vit_mnist.speed.allocator`) makes ``handwritten``'s steps
faster, and sets it for the run where it does; the paths are then timed under the mode the
run trains with, which can rank them differently (a step that frees large blocks pays more
page faults without it). Where the path and precision chosen are another pair, the mode is
timed again on them (a compiled path's eager counterpart stands in for it), as the answer
can differ between pairs: what a step allocates and frees, and so what keeping it saves,
depends on the path and precision.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vit_mnist.errors import ConfigError
from vit_mnist.models.vit import VisionTransformer
from vit_mnist.speed import allocator as malloc
from vit_mnist.speed import cache_root
from vit_mnist.speed.hardware import describe_hardware, hardware_key, has_native_bf16
from vit_mnist.speed.paths import PATHS

log = logging.getLogger(__name__)

PRECISIONS = ("32-true", "bf16-mixed")
# What a model's first compile is expected to take at least: the default model's took 36 to
# 50 s on a 2-core Zen 5 and 56 s on a 2-core Zen 3 (docs/speed.md).
FIRST_COMPILE_GUESS_S = 60.0
# A precision whose best eager path is this far behind the best is not compiled for.
COMPETITIVE = 0.9
# A candidate this far behind the leader after a round of timing is out of the running.
KEEP = 0.85
# Two candidates this close after the planned rounds are a race the rounds did not decide:
# they are timed on, within the time budget. Once a 2% lead was misread: `fused` over
# `native`, whose own row then ran 1.23x faster (docs/speed.md).
CLOSE = 0.97

Pair = tuple[str, str]  # (path, precision)


def _name(pair: Pair) -> str:
    return f"{pair[0]} {pair[1]}"


@dataclass
class Choice:
    """The path and precision a run trains with, and how they were chosen.

    Attributes:
        path: a key of :data:`~vit_mnist.speed.paths.PATHS`.
        precision: a Lightning precision, ``32-true`` or ``bf16-mixed`` when measured.
        images_per_s: ``"path precision" -> images/s`` for every candidate timed (empty
            when nothing was timed).
        seconds: wall seconds spent choosing (timing and compiling, or reading the cache).
        how: ``measured``, ``cached`` or ``forced``.
        skipped: ``path -> why`` for paths not timed.
        compile_s: ``"path precision" -> seconds`` of the first training step of each
            compiled candidate timed in this call (mostly compiling), part of ``seconds``.
        allocator: the ``malloc`` mode set for the run, ``retain`` or ``system``
            (:mod:`vit_mnist.speed.allocator`).
        allocator_images_per_s: ``mode -> images/s`` where it was timed (or cached).
        allocator_how: ``measured``, ``cached``, ``forced``, or why it was not timed.
    """

    path: str
    precision: str
    images_per_s: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    how: str = "forced"
    skipped: dict[str, str] = field(default_factory=dict)
    compile_s: dict[str, float] = field(default_factory=dict)
    allocator: str = "system"
    allocator_images_per_s: dict[str, float] = field(default_factory=dict)
    allocator_how: str = "forced"

    def describe(self, device: torch.device) -> str:
        """One log line: the choice, how long it took, every figure, what was left out."""
        figures = ", ".join(f"{k} {v:,.0f}" for k, v in self.images_per_s.items())
        line = f"speed path: {self.path}, precision {self.precision} ({self.how}"
        if self.how != "forced":
            line += f" in {self.seconds:.2f} s"
            if self.compile_s:
                line += f", {sum(self.compile_s.values()):.1f} s of it compiling"
        line += f"; {describe_hardware(device)})"
        if figures:
            line += f"; images/s: {figures}"
        line += f"; malloc: {self.allocator} ({self.allocator_how}"
        if self.allocator_images_per_s:
            timed = ", ".join(f"{k} {v:,.0f}" for k, v in self.allocator_images_per_s.items())
            line += f"; images/s: {timed}"
        line += ")"
        if self.how == "forced" and self.allocator_how == "measured":
            line += f"; chosen in {self.seconds:.2f} s"
        if self.how != "forced" and self.skipped:
            line += "; not timed: " + "; ".join(f"{p} ({why})" for p, why in self.skipped.items())
        return line


def check_speed_path(path: Any) -> None:
    """Raise ConfigError naming ``speed.path`` unless it is ``auto`` or a path's name."""
    if path != "auto" and path not in PATHS:
        raise ConfigError(f"speed.path={path!r} is unknown; use auto or one of {list(PATHS)}")


def check_allocator(mode: Any) -> None:
    """Raise ConfigError naming ``speed.allocator`` unless it is ``auto`` or a mode."""
    if mode != "auto" and mode not in malloc.MODES:
        raise ConfigError(
            f"speed.allocator={mode!r} is unknown; use auto or one of {list(malloc.MODES)}"
        )


def candidates(
    device: torch.device,
    path: str,
    precision: str,
    include_compiled: bool | str,
    net: VisionTransformer | None = None,
) -> tuple[list[Pair], dict[str, str]]:
    """The (path, precision) pairs ``choose`` may time, and ``path -> why`` for those left out.

    ``include_compiled``: ``False`` leaves the compiled paths out of ``auto``; ``True`` or
    ``"auto"`` keep them (``choose`` decides which it times). ``net``, when given, must be
    supported too (a model with pruned heads is not by every path, see
    :attr:`TrainingPath.unsupported`).

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
            if why is None and p.compiles and include_compiled is False:
                why = "compiles first; speed.auto_compile=false"
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


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _cache_key(device, model_args, batch_size, pairs) -> str:
    # Figures timed under one malloc mode can rank the paths otherwise than under the other.
    mode = malloc.current_mode() if device.type == "cpu" else None
    return _digest([hardware_key(device), model_args, batch_size, [list(p) for p in pairs], mode])


def _read_json(file: Path) -> dict[str, Any]:
    try:
        entries = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}  # a damaged file: start again


def _write_json(file: Path, entries: dict[str, Any]) -> None:
    from vit_mnist.io import atomic_write_bytes

    try:
        atomic_write_bytes(file, (json.dumps(entries, indent=1, sort_keys=True) + "\n").encode())
    except OSError as e:  # a read-only home: what was measured still holds for this run
        log.warning("%s not written (%s)", file.name, e)


def _choices_file() -> Path:
    return cache_root() / "speed_choices.json"


def _cached_speeds(key: str, pairs: list[Pair]) -> dict[str, float] | None:
    """The figures cached under ``key`` if they cover ``pairs`` (each a positive number),
    else None."""
    entry = _read_json(_choices_file()).get(key)
    if not isinstance(entry, dict) or not isinstance(entry.get("images_per_s"), dict):
        return None
    speeds = {_name(p): _number(entry["images_per_s"].get(_name(p))) for p in pairs}
    return speeds if all(v > 0 for v in speeds.values()) else None


def _cache_speeds(key: str, device: torch.device, speeds: dict[str, float]) -> None:
    file = _choices_file()
    entries = _read_json(file)
    best = max(speeds, key=speeds.get)
    path, precision = best.split(" ")
    entries[key] = {
        "path": path,
        "precision": precision,
        "images_per_s": speeds,
        "hardware": hardware_key(device),
    }
    _write_json(file, entries)


@dataclass
class CompileRecord:
    """What this machine (``hardware_key``) has compiled for one model, from
    ``$VIT_MNIST_CACHE/compile_times.json``.

    Attributes:
        compile_s: ``"path precision" -> seconds`` of this model's last compile here.
        first_compile_s: ``"path precision" -> seconds`` of the longest first compile of a
            model here (what a model never compiled here is expected to take, at least
            :data:`FIRST_COMPILE_GUESS_S`).
        trained_s: planned training seconds of this model's runs under ``auto`` here.
    """

    compile_s: dict[str, float]
    first_compile_s: dict[str, float]
    trained_s: float

    def expected_s(self, pair: Pair) -> float:
        """Seconds the first step of ``pair`` is expected to take to compile here: this
        model's last compile, else the longest first compile seen here, at least
        :data:`FIRST_COMPILE_GUESS_S`."""
        if _name(pair) in self.compile_s:
            return self.compile_s[_name(pair)]
        return max(self.first_compile_s.get(_name(pair), 0.0), FIRST_COMPILE_GUESS_S)


def _number(value: Any) -> float:
    """A recorded number, or 0 where the file holds something else."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _compile_file() -> Path:
    return cache_root() / "compile_times.json"


def _machine_and_model(entries: dict, device: torch.device, model_args: dict) -> tuple[dict, dict]:
    """This machine's entry and, inside it, the model's (each made, or remade where damaged)."""

    def child(parent: dict, key: str) -> dict:
        if not isinstance(parent.get(key), dict):
            parent[key] = {}
        return parent[key]

    machine = child(entries, hardware_key(device))
    return machine, child(child(machine, "models"), _digest(model_args))


def compile_record(device: torch.device, model_args: dict[str, Any]) -> CompileRecord:
    """What this machine has compiled for the model ``model_args`` (see :class:`CompileRecord`)."""
    try:
        machine, model = _machine_and_model(_read_json(_compile_file()), device, model_args)
        return CompileRecord(
            {k: float(v) for k, v in model.get("compile_s", {}).items()},
            {k: float(v) for k, v in machine.get("first_compile_s", {}).items()},
            float(model.get("trained_s", 0.0)),
        )
    except (AttributeError, TypeError, ValueError):  # a damaged entry: nothing known
        return CompileRecord({}, {}, 0.0)


def record_compile(
    device: torch.device, model_args: dict[str, Any], pair: Pair, seconds: float
) -> None:
    """Remember that ``pair`` compiled ``model_args`` here in ``seconds`` (its first step)."""
    file = _compile_file()
    entries = _read_json(file)
    machine, model = _machine_and_model(entries, device, model_args)
    for owner, key in ((model, "compile_s"), (machine, "first_compile_s")):
        if not isinstance(owner.get(key), dict):
            owner[key] = {}
    if _name(pair) not in model["compile_s"]:
        # The longest first compile seen: a model this record has not seen may still be
        # in inductor's own cache (then it compiles in seconds), but cannot be counted on.
        first = machine["first_compile_s"]
        first[_name(pair)] = round(max(seconds, _number(first.get(_name(pair)))), 2)
    model["compile_s"][_name(pair)] = round(seconds, 2)
    _write_json(file, entries)


def _add_trained_s(device: torch.device, model_args: dict[str, Any], seconds: float) -> None:
    file = _compile_file()
    entries = _read_json(file)
    _, model = _machine_and_model(entries, device, model_args)
    model["trained_s"] = round(_number(model.get("trained_s")) + seconds, 1)
    _write_json(file, entries)


@dataclass
class Timing:
    """What :func:`time_candidates` measured: the best round's images/s per candidate
    (``"path precision"``) and the seconds of each candidate's first step (a compiled
    path's compile)."""

    images_per_s: dict[str, float]
    first_step_s: dict[str, float]


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
    keep: float = KEEP,
    close: float = CLOSE,
) -> Timing:
    """Images/s of each (path, precision) over interleaved rounds of training steps
    (forward, cross-entropy, backward, fused AdamW step): the best of its rounds, since on
    a shared machine a moment of load only ever slows a round down (as :mod:`timeit` takes
    the minimum time).

    A round of a candidate is ``steps`` steps, or more where its steps are short: as many
    as its last measured step time (at first, its first step's) says fill ``min_round_s``
    seconds. On a GPU a step of the default model takes about 15 ms, and two of them are
    too short to time against the host's jitter in launching kernels.

    After each round a candidate below ``keep`` times the leader's best is dropped, so
    the rounds that follow go to the candidates close enough for the choice to matter; the
    timing ends when one is left, after ``rounds`` rounds, or after the round in which
    ``budget_s`` seconds (after the first steps) have passed, so a model whose steps take
    seconds is timed over one round. Where after ``rounds`` rounds another candidate is
    within ``close`` of the leader, the race is not decided: the candidates within
    ``close`` are timed on, up to ``3 * rounds`` rounds, until one leads by more (or the
    budget is spent). A single candidate is timed over ``rounds`` rounds (within
    ``budget_s``).

    Runs on a copy of ``net`` with a random batch of ``batch_size`` images, and restores
    the random-number state, so the run that follows is the same as without it.
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

    first_step_s = {}
    speeds: dict[Pair, list[float]] = {pair: [] for pair in pairs}
    try:
        for pair in pairs:
            # Allocations, kernel builds, oneDNN's first-call setup; a compiled path compiles.
            start = time.perf_counter()
            step(*pair)
            sync()
            first_step_s[_name(pair)] = time.perf_counter() - start
        step_s = {pair: first_step_s[_name(pair)] for pair in pairs}
        live = list(pairs)
        start = time.perf_counter()
        for r in range(3 * rounds):
            for pair in live if r % 2 == 0 else live[::-1]:  # either order: drift hits all
                n = max(steps, math.ceil(min_round_s / max(step_s[pair], 1e-6)))
                sync()
                t0 = time.perf_counter()
                for _ in range(n):
                    step(*pair)
                sync()
                step_s[pair] = (time.perf_counter() - t0) / n
                speeds[pair].append(batch_size / step_s[pair])
            leader = max(max(speeds[p]) for p in live)
            live = [p for p in live if max(speeds[p]) >= keep * leader]
            if r + 1 >= rounds:  # the planned rounds are done: on only with an open race
                live = [p for p in live if max(speeds[p]) >= close * leader]
            decided = len(live) == 1 and (len(pairs) > 1 or r + 1 >= rounds)
            if decided or time.perf_counter() - start > budget_s:
                break
    finally:
        torch.set_rng_state(rng)
        if cuda_rng:
            torch.cuda.set_rng_state_all(cuda_rng)
    return Timing({_name(p): max(v) for p, v in speeds.items()}, first_step_s)


def _compiled_to_time(
    compiled: list[Pair],
    eager_speeds: dict[str, float],
    *,
    include_compiled: bool | str,
    record: CompileRecord,
    run_s: float,
    compile_budget: float,
    skipped: dict[str, str],
) -> list[Pair]:
    """The compiled pairs worth timing; why the others are not goes into ``skipped``.

    Only at a precision whose best eager path is within :data:`COMPETITIVE` of the best
    (compiling does not turn a 10x slower emulated bf16 into the fastest). With
    ``include_compiled="auto"``, the cheapest expected compiles first, while their sum
    stays within ``compile_budget`` of the model's training time here, ``run_s`` (this
    run's) included.
    """
    best = max(eager_speeds.values())
    fast = {n.split(" ")[1] for n, v in eager_speeds.items() if v >= COMPETITIVE * best}
    trained = record.trained_s + run_s
    chosen, spent, why = [], 0.0, {}
    for pair in sorted(compiled, key=record.expected_s):
        expected = record.expected_s(pair)
        if pair[1] not in fast:
            why.setdefault(pair[0], []).append(f"{pair[1]} runs slower here")
        elif include_compiled == "auto" and spent + expected > compile_budget * trained:
            why.setdefault(pair[0], []).append(
                f"{pair[1]}: compiling is expected to take {expected:.0f} s, more than "
                f"speed.compile_budget={compile_budget:g} of the {trained:.0f} s this machine "
                "has trained this model (speed.auto_compile=true times it anyway)"
            )
        else:
            chosen.append(pair)
            spent += expected
    for path, reasons in why.items():
        if not any(p == path for p, _ in chosen):
            skipped[path] = "; ".join(reasons)
    return chosen


def choose(
    net: VisionTransformer,
    *,
    model_args: dict[str, Any],
    device: torch.device,
    batch_size: int,
    path: str = "auto",
    precision: str = "auto",
    include_compiled: bool | str = "auto",
    compile_budget: float = 0.05,
    planned_steps: int | None = None,
    use_cache: bool = True,
    record: CompileRecord | None = None,
    count_training: bool = True,
    allocator: str = "auto",
) -> Choice:
    """The path and precision to train ``net`` with on ``device``, and the ``malloc`` mode
    (set here, for the whole process) that the run trains under.

    Args:
        net: the model (not modified: the timing runs on a copy).
        model_args: the model's constructor arguments (part of the cache keys).
        device: where training runs.
        batch_size: images per training step (per process).
        path: ``auto`` or a path's name (forced).
        precision: ``auto`` (bf16-mixed only where the hardware computes bf16 and it
            measures faster) or a Lightning precision (forced).
        include_compiled: whether ``auto`` times the compiled paths: ``"auto"`` where their
            expected compile fits ``compile_budget`` (see the module's docstring), ``True``
            always, ``False`` never.
        compile_budget: the share of this model's training time on this machine that
            ``include_compiled="auto"`` may spend compiling, e.g. 0.05.
        planned_steps: training steps this run will take (per process), or None where
            unknown: with ``include_compiled="auto"``, how long it trains counts towards the
            budget.
        use_cache: read and write the cache of earlier choices, and record compiles and
            training time.
        record: what this machine has compiled and trained for this model; by default
            read from ``$VIT_MNIST_CACHE/compile_times.json`` (also without ``use_cache``).
        count_training: add this run's planned seconds to the model's training time here;
            False in every process of a multi-process run but one, which trains the same
            seconds alongside it.
        allocator: ``auto`` (``retain`` where it measures faster, on a CPU with glibc) or a
            mode of :mod:`vit_mnist.speed.allocator` (forced). Timed before the paths, on
            a forced eager path, else on ``handwritten`` (always available) at the first
            candidate precision; every path is then timed under it. Where the pair chosen
            is another (:func:`eager_counterpart` of it), ``auto`` times the mode again on
            that pair and keeps what is faster for it.

    Raises:
        ConfigError: an unknown path or allocator mode, or a forced one that cannot run here.
    """
    start = time.perf_counter()
    pairs, skipped = candidates(device, path, precision, include_compiled, net)
    check_allocator(allocator)
    settle = functools.partial(
        choose_allocator,
        net,
        mode=allocator,
        device=device,
        model_args=model_args,
        batch_size=batch_size,
        use_cache=use_cache,
    )
    forced_eager = len(pairs) == 1 and not PATHS[pairs[0][0]].compiles
    probe = pairs[0] if forced_eager else ("handwritten", pairs[0][1])
    settled = settle(probe=probe)
    choice = _choose_path(
        net,
        pairs,
        skipped,
        model_args=model_args,
        device=device,
        batch_size=batch_size,
        include_compiled=include_compiled,
        compile_budget=compile_budget,
        planned_steps=planned_steps,
        use_cache=use_cache,
        record=record,
        count_training=count_training,
    )
    chosen = eager_counterpart((choice.path, choice.precision))
    _, _, how = settled
    if allocator == "auto" and chosen != probe and how in ("measured", "cached"):
        settled = settle(probe=chosen)
    choice.allocator, choice.allocator_images_per_s, choice.allocator_how = settled
    if choice.how != "forced" or choice.allocator_how in ("measured", "cached"):
        choice.seconds = time.perf_counter() - start  # else nothing was timed or read
    return choice


def eager_counterpart(pair: Pair) -> Pair:
    """``pair`` itself, or for a compiled path the eager path whose steps stand for it when
    ``malloc`` is timed (:attr:`TrainingPath.eager <vit_mnist.speed.paths.TrainingPath>`)."""
    path, precision = pair
    return PATHS[path].eager or path, precision


def choose_allocator(
    net: VisionTransformer,
    probe: Pair,
    mode: str,
    *,
    device: torch.device,
    model_args: dict[str, Any],
    batch_size: int,
    use_cache: bool,
) -> tuple[str, dict[str, float], str]:
    """Set the ``malloc`` mode for the run; returns it, ``mode -> images/s`` where timed
    (or cached), and how it was chosen: ``measured``, ``cached``, ``forced`` or why not.

    ``auto`` times ``probe``'s training steps with ``malloc`` as it is (``system``), then
    with ``retain``, one after the other: glibc has no way back to its own thresholds once
    one is set, so the two cannot take turns. ``retain`` is kept only where it is faster.

    Raises:
        ConfigError: ``retain`` forced where it cannot be set.
    """
    if mode != "auto":
        why = malloc.unavailable()
        if mode == "retain" and why:
            raise ConfigError(
                f"speed.allocator=retain cannot be set here: {why}; use speed.allocator=auto"
            )
        malloc.set_mode(mode)
        return mode, {}, "forced"
    if device.type != "cpu":
        why = "the GPU's memory comes from PyTorch's caching allocator"
    else:
        why = malloc.unavailable()
    if why:
        return malloc.current_mode(), {}, f"not timed: {why}"
    key = _digest(["allocator", hardware_key(device), model_args, batch_size, list(probe)])
    entry = _read_json(_choices_file()).get(key) if use_cache else None
    if isinstance(entry, dict) and entry.get("allocator") in malloc.MODES:
        malloc.set_mode(entry["allocator"])
        figures = entry.get("images_per_s")
        figures = figures if isinstance(figures, dict) else {}
        numbers = {k: n for k, v in figures.items() if k in malloc.MODES and (n := _number(v))}
        return entry["allocator"], numbers, "cached"
    figures = {}
    for candidate in malloc.MODES[::-1]:  # system first: glibc's own thresholds
        malloc.set_mode(candidate)
        timing = time_candidates(net, [probe], device=device, batch_size=batch_size, budget_s=3.0)
        figures[candidate] = timing.images_per_s[_name(probe)]
    best = "retain" if figures["retain"] > figures["system"] else "system"
    malloc.set_mode(best)
    if use_cache:
        entries = _read_json(_choices_file())
        entries[key] = {
            "allocator": best,
            "images_per_s": figures,
            "hardware": hardware_key(device),
        }
        _write_json(_choices_file(), entries)
    return best, figures, "measured"


def _choose_path(
    net: VisionTransformer,
    pairs: list[Pair],
    skipped: dict[str, str],
    *,
    model_args: dict[str, Any],
    device: torch.device,
    batch_size: int,
    include_compiled: bool | str,
    compile_budget: float,
    planned_steps: int | None,
    use_cache: bool,
    record: CompileRecord | None,
    count_training: bool,
) -> Choice:
    """:func:`choose`'s path and precision among ``pairs`` (its other arguments are
    :func:`choose`'s), under the malloc mode already set."""
    if len(pairs) == 1:
        return Choice(*pairs[0], skipped=skipped)
    if all(PATHS[p].compiles for p, _ in pairs):
        # A forced compiled path with precision auto: timing it means compiling it once per
        # precision, so the precision is chosen on the handwritten eager path instead.
        speeds = _timed_or_cached(
            net, [("handwritten", q) for _, q in pairs], device, model_args, batch_size, use_cache
        )
        best = max(speeds.figures, key=speeds.figures.get)
        return Choice(pairs[0][0], best.split(" ")[1], speeds.figures, 0.0, speeds.how, skipped)
    eager = [p for p in pairs if not PATHS[p[0]].compiles]
    compiled = [p for p in pairs if PATHS[p[0]].compiles]
    first = _timed_or_cached(net, eager, device, model_args, batch_size, use_cache)
    figures, how, compile_s = dict(first.figures), first.how, {}
    best_eager = max(eager, key=lambda p: figures[_name(p)])
    to_time: list[Pair] = []
    if compiled:
        record = compile_record(device, model_args) if record is None else record
        run_s = (planned_steps or 0) * batch_size / figures[_name(best_eager)]
        to_time = _compiled_to_time(
            compiled,
            figures,
            include_compiled=include_compiled,
            record=record,
            run_s=run_s,
            compile_budget=compile_budget,
            skipped=skipped,
        )
        if use_cache and count_training and include_compiled == "auto" and run_s > 0:
            _add_trained_s(device, model_args, run_s)
    if to_time:
        # The compiled candidates against the eager ones that came close to the best,
        # interleaved in one timing: figures from two timings are not compared.
        lead = figures[_name(best_eager)]
        rivals = [p for p in eager if figures[_name(p)] >= KEEP * lead]
        second = _timed_or_cached(
            net, [*to_time, *rivals], device, model_args, batch_size, use_cache
        )
        figures.update(second.figures)
        compile_s = second.compile_s
        how = "measured" if "measured" in (how, second.how) else "cached"
        final = second.figures
    else:
        final = {_name(p): figures[_name(p)] for p in eager}
    best = max(final, key=final.get)
    return Choice(*best.split(" "), figures, 0.0, how, skipped, compile_s)


@dataclass
class _Figures:
    figures: dict[str, float]
    how: str
    compile_s: dict[str, float]


def _timed_or_cached(
    net: VisionTransformer,
    pairs: list[Pair],
    device: torch.device,
    model_args: dict[str, Any],
    batch_size: int,
    use_cache: bool,
) -> _Figures:
    """Images/s of ``pairs``: from the choice cache, else timed now (and cached). A compiled
    pair's first step, timed, is recorded as its compile time."""
    key = _cache_key(device, model_args, batch_size, pairs)
    if use_cache:
        cached = _cached_speeds(key, pairs)
        if cached is not None:
            return _Figures(cached, "cached", {})
    timing = time_candidates(net, pairs, device=device, batch_size=batch_size)
    compile_s = {}
    for pair in pairs:
        if PATHS[pair[0]].compiles:
            compile_s[_name(pair)] = timing.first_step_s[_name(pair)]
            if use_cache:
                record_compile(device, model_args, pair, compile_s[_name(pair)])
    if use_cache:
        _cache_speeds(key, device, timing.images_per_s)
    return _Figures(timing.images_per_s, "measured", compile_s)
