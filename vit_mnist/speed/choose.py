"""The named training paths (:data:`PATHS`), and choosing one with the precision by
measurement on the user's own machine (:func:`choose`, docs/speed.md "How auto chooses")."""

from __future__ import annotations

import copy
import functools
import importlib.util
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from vit_mnist.errors import ConfigError
from vit_mnist.hardware import describe_device, has_native_bf16, resolve_accelerator
from vit_mnist.models.vit import VisionTransformer
from vit_mnist.settings import PATH_NAMES
from vit_mnist.speed import native
from vit_mnist.speed.forward import add_norm, handwritten_backward_core, sdpa_core, vit_forward

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


@dataclass
class Choice:
    """The ``path`` (a key of :data:`PATHS`) and Lightning ``precision`` a run trains with;
    ``images_per_s`` (``"path precision" -> images/s``) of every candidate timed, in
    ``seconds`` of wall time, ``how`` (``measured`` or ``forced``), and ``skipped``
    (``path -> why`` for the paths not timed)."""

    path: str
    precision: str
    images_per_s: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    how: str = "forced"
    skipped: dict[str, str] = field(default_factory=dict)

    def describe(self, device: torch.device) -> str:
        """One log line: the choice, how long it took, every figure, what was left out."""
        took = "" if self.how == "forced" else f" in {self.seconds:.2f} s"
        line = f"speed path: {self.path}, precision {self.precision} ({self.how}{took}; "
        line += describe_device(device) + ")"
        figures = ", ".join(f"{k} {v:,.0f}" for k, v in self.images_per_s.items())
        line += f"; images/s: {figures}" if figures else ""
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
    budget_s: float = 6.0,
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Images/s of each (path, precision) pair: ``"path precision" -> images/s``, the median
    of ``rounds`` interleaved rounds (order reversed every other round) of ``steps`` steps,
    or as many as fill ``min_round_s`` seconds, after ``warmup_rounds`` untimed ones: in a
    fresh process the first candidate's first rounds ran 40-60% slow while the allocator
    grew its heap (docs/speed.md, "How auto chooses"). The rounds stop after ``budget_s``
    seconds once ``min_rounds`` timed ones have run: one round is one sample of a machine
    whose speed moves by 10% or more between rounds. A step is the loop's: ``augment`` of a
    random batch of ``batch_size`` images, forward, cross-entropy, backward, fused AdamW
    (docs/speed.md, "How auto chooses"). Runs on a copy of ``net`` and restores the
    random-number state: the run that follows is unchanged."""
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

        step_s = {pair: seconds_per_step(pair, 1) for pair in pairs}
        speeds: dict[Pair, list[float]] = {pair: [] for pair in pairs}
        start = time.perf_counter()
        for r in range(-warmup_rounds, rounds):
            for pair in pairs if r % 2 == 0 else pairs[::-1]:
                n = max(steps, math.ceil(min_round_s / max(step_s[pair], 1e-6)))
                step_s[pair] = seconds_per_step(pair, n)
                if r >= 0:
                    speeds[pair].append(batch_size / step_s[pair])
            if r + 1 >= min_rounds and time.perf_counter() - start > budget_s:
                break
        return {f"{p} {q}": statistics.median(v) for (p, q), v in speeds.items()}


def choose(
    net: nn.Module,
    *,
    device: torch.device,
    batch_size: int,
    path: str = "auto",
    precision: str = "auto",
    include_compiled: bool = False,
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Choice:
    """The path and precision (each ``auto`` or forced) to train ``net`` (not modified) with
    on ``device`` at ``batch_size`` images a step, timed afresh (:func:`time_candidates`,
    with ``augment`` in each step; ``include_compiled`` lets ``auto`` time compiled paths).

    Raises:
        ConfigError: a forced path that cannot run here.
    """
    start = time.perf_counter()
    pairs, skipped = candidates(device, path, precision, include_compiled, net)
    if len(pairs) == 1:
        return Choice(*pairs[0], skipped=skipped)
    speeds = time_candidates(net, pairs, device=device, batch_size=batch_size, augment=augment)
    best = max(speeds, key=speeds.get).split(" ")
    return Choice(*best, speeds, time.perf_counter() - start, "measured", skipped)


def prepare_speed(module: Any, cfg: DictConfig, datamodule: Any = None) -> Choice:
    """Choose the training path and precision for the run ``cfg`` (``speed.*``,
    ``trainer.accelerator``, ``trainer.precision``, ``data.batch_size``), timing
    ``datamodule.augment`` with each step, and put the path's forward of ``module.net`` into
    ``module.step_forward``. Logs the choice in one line.

    Raises:
        ConfigError: a forced path that cannot run here.
    """
    speed = cfg.get("speed") or {}
    device = torch.device(resolve_accelerator(str(cfg.trainer.get("accelerator", "auto"))))
    choice = choose(
        module.net,
        device=device,
        batch_size=cfg.data.batch_size,
        path=speed.get("path", "auto"),
        precision=str(cfg.trainer.get("precision", "auto")),
        include_compiled=bool(speed.get("compile", False)),
        augment=getattr(datamodule, "augment", None),
    )
    module.step_forward = PATHS[choice.path].build(module.net)
    log.info(choice.describe(device))
    return choice
