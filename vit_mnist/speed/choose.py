"""The named training paths (:data:`PATHS`), and choosing one with the precision by
measurement on the user's own machine (:func:`choose`, docs/speed.md "How auto chooses")."""

from __future__ import annotations

import copy
import functools
import importlib.util
import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from vit_mnist.console import progress
from vit_mnist.errors import ConfigError
from vit_mnist.hardware import describe_device, has_native_bf16, resolve_accelerator
from vit_mnist.models.vit import VisionTransformer
from vit_mnist.settings import PATH_NAMES
from vit_mnist.speed import cache_root, native
from vit_mnist.speed.forward import add_norm, handwritten_backward_core, sdpa_core, vit_forward
from vit_mnist.speed.stored_choices import StoredChoice, choice_key, read_choice, write_choice

log = logging.getLogger(__name__)

Pair = tuple[str, str]  # (path, precision)


def _vit_only(net: nn.Module) -> str | None:
    return None if isinstance(net, VisionTransformer) else "a convnet runs on the reference path"


@dataclass(frozen=True)
class TrainingPath:
    """A way to run the training step: ``build`` (model -> its forward ``images (B, C, H, W)
    -> logits (B, num_classes)``, with ``heads=True`` a distilled ViT's two heads' logits, on
    the model's own modules), ``unavailable`` (device -> why it cannot run there, or None),
    ``unsupported`` (model -> why it cannot run it, or None) and ``compiles`` (the first
    training step compiles; evaluation runs eagerly)."""

    build: Callable[[nn.Module], Callable[..., Any]]
    unavailable: Callable[[torch.device], str | None] = lambda device: None
    unsupported: Callable[[nn.Module], str | None] = _vit_only
    compiles: bool = False


def _reference(net: nn.Module) -> Callable[..., Any]:
    def forward(x: torch.Tensor, heads: bool = False) -> Any:
        return net.forward_heads(net.forward_features(x)) if heads else net(x)

    return forward


def compile_step(fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """``torch.compile(fn, dynamic=True)`` (one graph for every batch size) for training
    steps on ``device``; on CUDA with CUDA graphs (``mode="reduce-overhead"``), since the
    eager step there waits on the host's kernel launches (docs/speed.md). Float attributes
    (dropout ``p``, LayerNorm ``eps``) are traced as constants (``specialize_float``)."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    compiled = torch.compile(fn, dynamic=True, mode=mode)

    def step(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(*args, **kwargs)

    return step


def _compiled(net: nn.Module) -> Callable[..., Any]:
    """:func:`vit_forward` compiled by :func:`compile_step` at the first training step;
    eager without gradients (validation, test): a graph of its own would cost a compile."""
    compiled = None

    def forward(x: torch.Tensor, heads: bool = False) -> Any:
        nonlocal compiled
        if not torch.is_grad_enabled():
            return vit_forward(net, x, heads=heads)
        if compiled is None:
            compiled = compile_step(functools.partial(vit_forward, net), x.device)
        return compiled(x, heads=heads)

    return forward


def _compile_unavailable(device: torch.device) -> str | None:
    if device.type == "cuda":
        return None if importlib.util.find_spec("triton") else "triton is not installed"
    if device.type != "cpu":
        return f"not supported on {device.type}"
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()  # inductor's own choice (its cpp.cxx setting, $CXX)
    except InvalidCxxCompiler:
        return "no working C++ compiler (install g++)"
    return None


def _native_unavailable(device: torch.device) -> str | None:
    if device.type != "cpu":
        return "CPU only"
    if native.build_target() is None:
        return f"needs AVX2 or AVX-512, this CPU runs PyTorch at {native.isa_class()}"
    if not torch.backends.openmp.is_available():
        return "this torch build has no OpenMP"
    return None if native.compiler() else "no C++ compiler found (install g++)"


def _native_unsupported(net: nn.Module) -> str | None:
    """A kernel that cannot be built for the model's shape (built now) leaves the path out
    rather than run PyTorch's operations under its name."""
    return _vit_only(net) or native.build_failure(net.num_tokens, net.blocks[0].attn.head_dim)


def _core(
    core: Callable, add_norm: Callable = add_norm
) -> Callable[[nn.Module], Callable[..., Any]]:
    return lambda net: functools.partial(vit_forward, net, core=core, add_norm=add_norm)


# In PATH_NAMES' order. Every path but the reference runs the last block for the CLS token
# only and the patch embedding as a matrix product (vit_mnist/speed/forward.py).
_NATIVE = _core(native.native_core, native.add_norm)
PATHS: dict[str, TrainingPath] = dict(
    zip(
        PATH_NAMES,
        [
            TrainingPath(_reference, unsupported=lambda net: None),  # the model, autograd
            TrainingPath(_core(sdpa_core)),  # scaled_dot_product_attention
            TrainingPath(_core(handwritten_backward_core)),  # the backward written out
            TrainingPath(_compiled, _compile_unavailable, compiles=True),  # inductor
            # C++ kernels: attention (AVX2, AVX-512), residual add + LayerNorm (AVX-512).
            TrainingPath(_NATIVE, _native_unavailable, _native_unsupported),
        ],
        strict=True,
    )
)


# How a choice was made, as metrics.json's speed_choice and the log line say it.
HOW = {
    "forced": "forced",
    "measured": "measured now in {seconds:.2f} s",
    "reused": "reused in {seconds:.2f} s, speed.remeasure=true measures again",
    "re-timed": "reused, its leaders timed again now in {seconds:.2f} s",
    "default": "not timed ({seconds:.2f} s), the class's default",
}


@dataclass
class Choice:
    """The ``path`` (a key of :data:`PATHS`) and Lightning ``precision`` a run trains with;
    ``images_per_s`` (``"path precision" -> images/s``) it was chosen on (this run's
    timing, else the medians of the stored timings), ``seconds`` of wall time spent
    choosing, ``how`` (:data:`HOW`), ``skipped`` (``path -> why`` for the paths not timed),
    ``note`` (what the log line adds: when it was measured, what the timing saw) and
    ``key`` (the stored choice's, :func:`~vit_mnist.speed.stored_choices.choice_key`; None
    where none is stored)."""

    path: str
    precision: str
    images_per_s: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    how: str = "forced"
    skipped: dict[str, str] = field(default_factory=dict)
    note: str = ""
    key: dict[str, Any] | None = None

    def describe(self, device: torch.device) -> str:
        """One log line: the choice, how it was made and in how long, every figure, what
        was left out."""
        how = HOW[self.how].format(seconds=self.seconds)
        note = f"; {self.note}" if self.note else ""
        line = f"speed path: {self.path}, precision {self.precision} ({how}{note}; "
        line += describe_device(device) + ")"
        figures = ", ".join(f"{k} {v:,.0f}" for k, v in self.images_per_s.items())
        line += f"; images/s: {figures}" if figures else ""
        if self.how != "forced" and self.skipped:
            line += "; not timed: " + "; ".join(f"{p} ({why})" for p, why in self.skipped.items())
        return line

    def metrics(self) -> dict[str, Any]:
        """The choice's keys of ``metrics.json``: ``speed_path``, ``speed_choice`` (how: a key
        of :data:`HOW`), ``speed_choice_s`` (seconds, left out of the fitting time) and
        ``speed_images_per_s`` (the figures it was chosen on)."""
        return {
            "speed_path": self.path,
            "speed_choice": self.how,
            "speed_choice_s": round(self.seconds, 3),
            "speed_images_per_s": {k: round(v, 1) for k, v in self.images_per_s.items()},
        }


def candidates(
    device: torch.device, path: str, precision: str, include_compiled: bool, net=None
) -> tuple[list[Pair], dict[str, str]]:
    """The (path, precision) pairs :func:`choose` may time, and ``path -> why`` for those
    left out (the compiled ones unless ``include_compiled``; those ``net`` cannot run).

    Raises:
        ConfigError: a forced path that cannot run on ``device`` or ``net``, saying why.
    """
    paths, skipped = [], {}
    for name, p in PATHS.items() if path == "auto" else [(path, PATHS[path])]:
        why = p.unavailable(device) or (None if net is None else p.unsupported(net))
        if path != "auto" and why:
            raise ConfigError(f"speed.path={path} cannot run here: {why}; use speed.path=auto")
        if why is None and p.compiles and not include_compiled and path == "auto":
            why = "compiles first, 30-60 s; speed.compile=true times it"
        if why is None:
            paths.append(name)
        else:
            skipped[name] = why
    precisions = [precision] if precision != "auto" else ["32-true"]
    if precision == "auto" and has_native_bf16(device.type == "cuda"):
        precisions.append("bf16-mixed")
    # A compiled path at the last precision only (bf16 where the hardware has it): one compile.
    pairs = [(p, q) for p in paths for q in (precisions[-1:] if PATHS[p].compiles else precisions)]
    return pairs, skipped


# The timing's share of a run's projected fitting time, and its ceiling in seconds: a run
# too short to pay for the timing's least (one untimed step, the untimed and the minimum
# timed rounds of every candidate) trains on the stored choice, or the class's default.
TIMING_SHARE = 0.05
MAX_TIMING_S = 15.0
# A candidate whose best round so far is below this share of the leader's median round is
# dropped: on a shared VM one round moves by 10% or more either way, never by 20%
# twice over (docs/speed.md).
DROP_BELOW = 0.8
# Rounds disagree when the leader's fastest round is this much above its slowest: the
# machine's speed moved during the timing, and the next run times the leaders again.
ROUNDS_AGREE = 0.25
# A loop below this share of the chosen step's stored figure, or above its inverse, ran
# well off it (the loop ran at 0.74 to 1.15 of the step on idle machines, docs/speed.md):
# the choice is timed again by the next run.
LOOP_SHORT = 0.6
# The leaders an unsettled choice times again: those within this share of the best; and
# how often before the median of its timings settles it.
LEADERS_WITHIN = 0.8
MAX_RETIMES = 2


@dataclass
class Timing:
    """What :func:`time_candidates` measured: ``figures`` (``"path precision"`` -> images/s,
    each pair's median round; a pair with no timed round has its last untimed one),
    ``spread`` (the leader's fastest round over its slowest, less 1), ``rounds`` (timed
    rounds run), ``dropped`` (pairs dropped early, behind the leader) and ``cut_short``
    (the budget ended it before ``min_rounds``)."""

    figures: dict[str, float]
    spread: float = 0.0
    rounds: int = 0
    dropped: list[str] = field(default_factory=list)
    cut_short: bool = False

    def agrees(self) -> bool:
        """The rounds agreed within :data:`ROUNDS_AGREE` and all ``min_rounds`` ran."""
        return self.spread <= ROUNDS_AGREE and not self.cut_short


def time_candidates(
    net: VisionTransformer,
    pairs: list[Pair],
    *,
    device: torch.device,
    batch_size: int,
    rounds: int = 5,
    min_rounds: int = 3,
    warmup_rounds: int = 2,
    steps: int = 2,
    min_round_s: float = 0.1,
    budget_s: float = MAX_TIMING_S,
    steps_to_train: float | None = None,
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
    progress: Callable[[], None] = lambda: None,
) -> Timing:
    """Images/s of each (path, precision) pair, the median of up to ``rounds`` interleaved
    rounds (order reversed every other round) of ``steps`` steps, or as many as fill
    ``min_round_s`` seconds, after an untimed first step and ``warmup_rounds`` untimed
    rounds: in a fresh process the first candidate's first rounds ran 40-60% slow while the
    allocator grew its heap (docs/speed.md, "How auto chooses"). After 2 timed rounds a pair
    whose best round is below :data:`DROP_BELOW` of the leader's median is dropped. The whole
    timing stops at ``budget_s`` seconds, or at :data:`TIMING_SHARE` of
    ``steps_to_train`` steps of the first pair's first step where that is less, checked before
    each pair's steps (so it ends within one pair's steps of it). A step
    is the loop's: ``augment`` of a random batch of ``batch_size`` images, forward,
    cross-entropy, backward, fused AdamW. Runs on a copy of ``net`` and restores the
    random-number state: the run that follows is unchanged. ``progress`` is called once per
    first step and once per round."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        model = copy.deepcopy(net).to(device).train()
        images = torch.randn(
            batch_size, model.in_chans, model.img_size, model.img_size, device=device
        )
        labels = torch.randint(0, model.head.out_features, (batch_size,), device=device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        forwards = {p: PATHS[p].build(model) for p, _ in pairs}
        sync = functools.partial(torch.cuda.synchronize, device) if cuda else lambda: None

        def seconds_per_step(pair: Pair, n: int) -> float:
            sync()
            start = time.perf_counter()
            for _ in range(n):
                batch = images if augment is None else augment(images)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled="bf16" in pair[1]):
                    loss = F.cross_entropy(forwards[pair[0]](batch), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            sync()
            return (time.perf_counter() - start) / n

        return _rounds(
            pairs,
            seconds_per_step,
            batch_size,
            progress,
            rounds=rounds,
            min_rounds=min_rounds,
            warmup_rounds=warmup_rounds,
            steps=steps,
            min_round_s=min_round_s,
            budget_s=budget_s,
            steps_to_train=steps_to_train,
        )


def _rounds(
    pairs: list[Pair],
    seconds_per_step: Callable[[Pair, int], float],
    batch_size: int,
    progress: Callable[[], None],
    *,
    rounds: int,
    min_rounds: int,
    warmup_rounds: int,
    steps: int,
    min_round_s: float,
    budget_s: float,
    steps_to_train: float | None,
) -> Timing:
    """:func:`time_candidates`' rounds over ``pairs``, each pair's step timed by
    ``seconds_per_step(pair, n)`` (seconds a step over ``n`` steps)."""
    start = time.perf_counter()
    step_s: dict[Pair, float] = {}
    for pair in pairs:  # untimed first steps; a pair not reached in budget is left out
        if time.perf_counter() - start > budget_s:
            break
        step_s[pair] = seconds_per_step(pair, 1)
        if steps_to_train is not None and len(step_s) == 1:  # a share of the run's time
            budget_s = min(budget_s, TIMING_SHARE * steps_to_train * step_s[pair])
        progress()
    speeds: dict[Pair, list[float]] = {pair: [] for pair in step_s}
    live, dropped, timed, out_of_time = list(step_s), [], 0, len(step_s) < len(pairs)
    for r in range(-warmup_rounds, rounds if not out_of_time else -warmup_rounds):
        for pair in live if r % 2 == 0 else live[::-1]:
            out_of_time = time.perf_counter() - start > budget_s
            if out_of_time:
                break
            n = max(steps, math.ceil(min_round_s / max(step_s[pair], 1e-6)))
            step_s[pair] = seconds_per_step(pair, n)
            if r >= 0:
                speeds[pair].append(batch_size / step_s[pair])
        else:
            timed += r >= 0
            progress()
        if r >= 1 and not out_of_time:
            lead = max(statistics.median(speeds[p]) for p in live)
            dropped += [p for p in live if max(speeds[p]) < DROP_BELOW * lead]
            live = [p for p in live if p not in dropped]
        if out_of_time or (dropped and len(live) == 1):
            break
    figures = {
        f"{p} {q}": statistics.median(speeds[(p, q)]) if speeds[(p, q)] else batch_size / s
        for (p, q), s in step_s.items()
    }
    best = max(step_s, key=lambda p: figures[f"{p[0]} {p[1]}"])
    spread = max(speeds[best]) / min(speeds[best]) - 1 if speeds[best] else 0.0
    cut_short = out_of_time and timed < min(min_rounds, rounds)
    return Timing(figures, spread, timed, [f"{p} {q}" for p, q in dropped], cut_short)


def default_pair(pairs: list[Pair], device: torch.device) -> Pair:
    """The pair a run trains with when nothing is stored and the run is too short to time:
    the path that led on the device's class in docs/speed.md (``native`` on CPUs, else
    ``handwritten``; ``fused`` on CUDA), never a compiled one, at bfloat16 where that is a
    candidate (the hardware computes it)."""
    order = ["fused", "reference"] if device.type == "cuda" else ["native", "handwritten"]
    names = [p for p, _ in pairs if not PATHS[p].compiles] or [p for p, _ in pairs]
    path = next((p for p in order if p in names), names[0])
    precisions = [q for p, q in pairs if p == path]
    return path, "bf16-mixed" if "bf16-mixed" in precisions else precisions[0]


def too_short_to_time(pairs: list[Pair], steps_to_train: int | None) -> bool:
    """A run whose :data:`TIMING_SHARE` cannot pay for the least timing of ``pairs``: one
    untimed step, two untimed and three timed rounds of two steps each (``steps_to_train``
    None: unknown, taken as long)."""
    least_steps = len(pairs) * (1 + (2 + 3) * 2)
    return steps_to_train is not None and steps_to_train * TIMING_SHARE < least_steps


def _leaders(stored: StoredChoice, pairs: list[Pair]) -> list[Pair]:
    """What an unsettled choice times again: its two best pairs, any other within
    :data:`LEADERS_WITHIN` of the best median, and the pairs it has no figure of (a timing
    cut short before them), best first."""
    medians = stored.medians()
    ranked = sorted(pairs, key=lambda p: -medians.get(f"{p[0]} {p[1]}", math.inf))
    best = max(medians.values())
    return [
        p
        for i, p in enumerate(ranked)
        if i < 2 or medians.get(f"{p[0]} {p[1]}", math.inf) >= LEADERS_WITHIN * best
    ]


def choose(
    net: nn.Module,
    *,
    device: torch.device,
    batch_size: int,
    path: str = "auto",
    precision: str = "auto",
    include_compiled: bool = False,
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
    model_args: dict[str, Any] | None = None,
    steps_to_train: int | None = None,
    remeasure: bool = False,
    progress: Callable[[], None] = lambda: None,
) -> Choice:
    """The path and precision (each ``auto`` or forced) to train ``net`` (not modified) with
    on ``device`` at ``batch_size`` images a step, for a run of ``steps_to_train`` steps
    (None: unknown). ``auto`` reuses the settled choice stored under the same key
    (:func:`~vit_mnist.speed.stored_choices.choice_key`, with ``model_args``), times an
    unsettled one's leaders again, and with none stored (or ``remeasure``) times every
    candidate (:func:`time_candidates`, with ``augment`` and ``progress``) in
    :data:`TIMING_SHARE` of the run's projected time, at most :data:`MAX_TIMING_S`; a run
    too short for that (:func:`too_short_to_time`) takes the stored choice, else
    :func:`default_pair`. ``include_compiled`` lets ``auto`` time compiled paths.

    Raises:
        ConfigError: a forced path that cannot run here.
    """
    start = time.perf_counter()
    pairs, skipped = candidates(device, path, precision, include_compiled, net)
    if len(pairs) == 1:
        return Choice(*pairs[0], skipped=skipped)
    # Without model_args (scripts/benchmark.py) nothing is read or stored: a fresh timing.
    key = (
        None if model_args is None else choice_key(device, model_args, batch_size, precision, pairs)
    )
    stored = None if remeasure or key is None else read_choice(key)
    short = too_short_to_time(pairs, steps_to_train)
    if stored is not None and (stored.settled or short):
        return _from_store(stored, skipped, time.perf_counter() - start, "reused")
    if short:
        why = f"{steps_to_train} steps are too few to pay for a timing"
        return Choice(
            *default_pair(pairs, device), {}, time.perf_counter() - start, "default", skipped, why
        )
    # The likeliest winner first: a timing cut short by its budget has its figure.
    first = default_pair(pairs, device)
    timed = _leaders(stored, pairs) if stored else [first, *(p for p in pairs if p != first)]
    timing = time_candidates(
        net,
        timed,
        device=device,
        batch_size=batch_size,
        augment=augment,
        budget_s=MAX_TIMING_S,
        steps_to_train=steps_to_train,
        progress=progress,
    )
    entry = stored or StoredChoice(key)
    entry.add(timing.figures)
    entry.retimes += stored is not None
    # Settled: rounds that agreed and, for an unsettled choice timed again, the same leader
    # in this timing as over every run's figures; or timed again MAX_RETIMES times (a busy
    # machine, whose timings never agree: the median of three then decides).
    best = max(timing.figures, key=timing.figures.get)
    agreed = timing.agrees() and entry.best() == best
    entry.settled = agreed or entry.retimes >= MAX_RETIMES
    how = "measured" if stored is None else "re-timed"
    return _from_store(entry, skipped, time.perf_counter() - start, how, timing)


def _from_store(
    entry: StoredChoice,
    skipped: dict[str, str],
    seconds: float,
    how: str,
    timing: Timing | None = None,
) -> Choice:
    """The choice: this run's ``timing``'s fastest where it timed (its candidates side by
    side, at one moment of the machine), else the best median of ``entry``'s runs; the
    entry is written back after a timing, and the note says what the timing saw."""
    stored = entry.key is not None and timing is not None and write_choice(entry)
    figures = entry.medians() if timing is None else timing.figures
    path, precision = max(figures, key=figures.get).split(" ")
    notes = [f"chosen on {entry.measured_on}" if how != "measured" else ""]
    notes += ["stored for later runs" if how == "measured" and stored else ""]
    if timing is not None and timing.dropped:
        notes += ["dropped early: " + ", ".join(timing.dropped)]
    if timing is not None:
        said = [f"rounds disagreed by {timing.spread:.0%}"] if timing.spread > ROUNDS_AGREE else []
        said += [f"cut short after {timing.rounds} rounds"] if timing.cut_short else []
        then = "settled" if entry.settled else "the next run times the leaders again"
        notes += [f"{', '.join(said)}: {then}"] if said or not entry.settled else []
    note = "; ".join(n for n in notes if n)
    return Choice(path, precision, figures, seconds, how, skipped, note, entry.key)


def note_loop_speed(choice: Choice, images_per_s: float | None, processes: int = 1) -> None:
    """After training: where the loop (``images_per_s``, images/s over all ``processes``;
    None: not measured) ran at under :data:`LOOP_SHORT` of the stored figure of the path
    and precision it trained with (a lucky timing), or above its inverse (a timing taken
    while something else ran), the stored choice is marked unsettled, so that the next run
    with its key times the leaders again."""
    figure = choice.images_per_s.get(f"{choice.path} {choice.precision}")
    images_per_s = images_per_s / processes if images_per_s else None
    if choice.key is None or not figure or not images_per_s:
        return
    if LOOP_SHORT * figure <= images_per_s <= figure / LOOP_SHORT:
        return
    stored = read_choice(choice.key)
    if stored is None:
        return
    stored.settled, stored.retimes = False, 0
    write_choice(stored)
    log.info(
        "the loop ran at %s images/s, %.0f%% of the %s figure the speed path was chosen on: "
        "the next run with this model times the leading paths again",
        f"{images_per_s:,.0f}",
        100 * images_per_s / figure,
        f"{figure:,.0f}",
    )


def steps_to_train(cfg: DictConfig, datamodule: Any, start_step: int = 0) -> int | None:
    """Optimiser steps the run ``cfg`` will take from ``start_step``: ``trainer.max_epochs``
    epochs of the datamodule's ``train_size`` in ``data.batch_size`` batches (cut by
    ``trainer.limit_train_batches`` and ``max_steps``), split over ``trainer.devices``
    processes for DDP; None where the data's size or the epoch count is not known."""
    size, trainer = getattr(datamodule, "train_size", None), cfg.trainer
    epochs = trainer.get("max_epochs")
    if not isinstance(size, int) or epochs is None or epochs < 0:
        return None
    batches = math.ceil(size / cfg.data.batch_size)
    limit = trainer.get("limit_train_batches")
    if isinstance(limit, int) and not isinstance(limit, bool):
        batches = min(batches, limit)
    elif isinstance(limit, float):
        batches = int(batches * limit)
    devices = trainer.get("devices")
    if isinstance(devices, int) and devices > 1 and str(trainer.get("strategy")).startswith("ddp"):
        batches = math.ceil(batches / devices)
    steps = epochs * batches
    max_steps = trainer.get("max_steps")
    if isinstance(max_steps, int) and max_steps > 0:
        steps = min(steps, max_steps)
    return max(0, steps - start_step)


def prepare_speed(
    module: Any, cfg: DictConfig, datamodule: Any = None, start_step: int = 0
) -> Choice:
    """Choose the training path and precision for the run ``cfg`` (``speed.*``,
    ``trainer.accelerator``, ``trainer.precision``, ``data.batch_size``), timing
    ``datamodule.augment`` with each step, for the steps left after ``start_step``
    (:func:`steps_to_train`), and put the path's forward of ``module.net`` into
    ``module.step_forward``. Shows a progress bar while it times (on a terminal, unless the
    training's bar is off) and logs the choice in one line.

    Raises:
        ConfigError: a forced path that cannot run here.
    """
    speed = cfg.get("speed") or {}
    device = torch.device(resolve_accelerator(str(cfg.trainer.get("accelerator", "auto"))))
    if bool(speed.get("compile", False)) or speed.get("path") == "compile":
        keep_compiles()
    # As the training loop's bar: off with trainer.enable_progress_bar=false or
    # callbacks.progress_bar=null.
    callbacks = cfg.get("callbacks")
    shown = callbacks is None or callbacks.get("progress_bar") is not None
    bar = shown and bool(cfg.trainer.get("enable_progress_bar", True))
    with progress(None, "timing the speed paths", enabled=bar) as shown:
        choice = choose(
            module.net,
            device=device,
            batch_size=cfg.data.batch_size,
            path=speed.get("path", "auto"),
            precision=str(cfg.trainer.get("precision", "auto")),
            include_compiled=bool(speed.get("compile", False)),
            augment=getattr(datamodule, "augment", None),
            model_args=dict(getattr(module, "hparams", {}).get("model") or {}),
            steps_to_train=steps_to_train(cfg, datamodule, start_step),
            remeasure=bool(speed.get("remeasure", False)),
            progress=shown.update,
        )
    module.step_forward = PATHS[choice.path].build(module.net)
    log.info(choice.describe(device))
    return choice


def keep_compiles() -> None:
    """Put inductor's on-disk caches (its FX graph cache and AOTAutograd's) in
    ``<cache_root()>/inductor`` and switch both on, unless ``TORCHINDUCTOR_CACHE_DIR`` names
    a folder of the user's: a second compiled run of the same shape then loads its kernels
    instead of generating and compiling them again (docs/speed.md, the compiled path), and
    they outlive a reboot, which inductor's default in /tmp does not."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # Importing torch's compiler fills in its default: a value equal to it is not the user's.
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given is None or os.path.abspath(given) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
