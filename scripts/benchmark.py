"""Training-step throughput and memory: every speed path of ours against timm and vit-pytorch.

python scripts/benchmark.py              # this CPU class's section of docs/benchmarks.md
python scripts/benchmark.py --patch 7 --archs default --out -    # train.py's patch; print
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
    TORCHINDUCTOR_CPP_MARCH=x86-64-v3 python scripts/benchmark.py   # an AVX2 CPU, emulated

Needs the `bench` extra (pip install -e '.[bench]': timm, vit-pytorch).

Every implementation is built with the same architecture (image 28, 1 channel, 10 classes,
class token, the same patch size, embed_dim, depth, heads and MLP width), trained with
AdamW on the same random batch at the same precision, in this one process. Ours runs once
per speed path (vit_mnist/speed: the same model and parameters, only the way the step is
computed differs), and as `auto`: the path that ``speed.path=auto`` picks here (timed
afresh, not from the cache), with the default ``speed.compile=false`` and, where the
architecture has compiled rows, with ``speed.compile=true``; its row is that path's own.
After warm-up steps the implementations take
turns, in the opposite order every other repetition: each repetition times `--steps`
training steps (forward, cross-entropy, backward, fused AdamW step) of every
implementation in turn, so a drift in the machine's speed touches all of them alike. The
table gives the median images/s over the repetitions and the median of each repetition's
ratio to the faster peer in that repetition (pair by pair, so a slow moment of the
machine cancels out of the ratio).

Each run writes the section of docs/benchmarks.md for this hardware (CPU model and
instruction-set class, or GPU), keeping the other classes' sections: one table per class.
A class emulated with ``ATEN_CPU_CAPABILITY`` is named so.

Memory: on CUDA, the peak of torch.cuda.max_memory_allocated during a step; on the CPU,
where PyTorch keeps no such counter, the bytes autograd saves for the backward pass
(the activations, the bulk of a training step's memory), counted with
torch.autograd.graph.saved_tensors_hooks.

Differences that cannot be removed: vit-pytorch's patch embedding has a LayerNorm before
and after its Linear (two more LayerNorms than ours and timm's), and its QKV projection has
no bias; ours and timm's are built with qkv_bias=False to match the latter.
"""

# ruff: noqa: E402 - torch and the project are imported once --help has had its answer

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ARCHS = {
    # The default config's width, depth and heads.
    "default": dict(embed_dim=64, depth=6, num_heads=4, mlp_dim=128),
    "larger": dict(embed_dim=192, depth=6, num_heads=6, mlp_dim=384),
}
IMG, CLASSES = 28, 10
PATCH = 4  # --patch sets it
PEERS = ("timm", "vit-pytorch")


def build_parser() -> argparse.ArgumentParser:
    """The command line; built before torch is imported, so that --help answers at once."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--patch", type=int, default=4, choices=[2, 4, 7, 14])
    parser.add_argument("--steps", type=int, default=10, help="training steps per repetition")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--out", default="docs/benchmarks.md", help="Markdown file, or -")
    parser.add_argument("--archs", nargs="+", choices=list(ARCHS), default=list(ARCHS))
    parser.add_argument(
        "--compile-archs",
        nargs="*",
        choices=list(ARCHS),
        default=["default"],
        help="architectures that also get the torch.compile rows (compiling takes minutes)",
    )
    parser.add_argument(
        "--bf16",
        choices=["auto", "yes", "no"],
        default="auto",
        help="bf16 autocast rows: auto = where the hardware computes bf16",
    )
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help (or a bad flag) answers here, before the imports


import torch
import torch.nn.functional as F
from torch import nn

from vit_mnist.hardware import cpu_class, cpu_name, has_native_bf16, isa_class
from vit_mnist.models import VisionTransformer
from vit_mnist.speed.choose import PATHS, choose, compile_step


def arch_label(name: str) -> str:
    a = ARCHS[name]
    return (
        f"{name} (patch {PATCH}, embed_dim {a['embed_dim']}, depth {a['depth']}, "
        f"{a['num_heads']} heads, MLP {a['mlp_dim']})"
    )


def reference_vit(embed_dim, depth, num_heads, mlp_dim) -> VisionTransformer:
    return VisionTransformer(
        img_size=IMG,
        patch_size=PATCH,
        in_chans=1,
        num_classes=CLASSES,
        embed_dim=embed_dim,
        depth=depth,
        num_heads=num_heads,
        mlp_ratio=mlp_dim / embed_dim,
        qkv_bias=False,
    )


class OnPath(nn.Module):
    """Our model run on one speed path: the parameters are ``net``'s, the step the path's."""

    def __init__(self, net: VisionTransformer, path: str) -> None:
        super().__init__()
        self.net = net
        self.step_forward = PATHS[path].build(net)  # a function, not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.step_forward(x)


def ours(path: str) -> Callable[..., nn.Module]:
    def build(**arch) -> nn.Module:
        return OnPath(reference_vit(**arch), path)

    return build


def timm_vit(embed_dim, depth, num_heads, mlp_dim):
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    return TimmViT(
        img_size=IMG,
        patch_size=PATCH,
        in_chans=1,
        num_classes=CLASSES,
        embed_dim=embed_dim,
        depth=depth,
        num_heads=num_heads,
        mlp_ratio=mlp_dim / embed_dim,
        qkv_bias=False,
        class_token=True,
        global_pool="token",
    )


def vit_pytorch(embed_dim, depth, num_heads, mlp_dim):
    from vit_pytorch import ViT

    return ViT(
        image_size=IMG,
        patch_size=PATCH,
        num_classes=CLASSES,
        dim=embed_dim,
        depth=depth,
        heads=num_heads,
        dim_head=embed_dim // num_heads,
        mlp_dim=mlp_dim,
        channels=1,
    )


class Compiled(nn.Module):
    """A peer compiled as our compile path is, at its first step (CUDA graphs on CUDA)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.step = None  # compiled at the first step, for its device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step is None:
            self.step = compile_step(self.model, x.device)
        return self.step(x)


def compiled_peer(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    def build(**arch) -> nn.Module:
        return Compiled(builder(**arch))

    return build


PEER_BUILDERS = {"timm": timm_vit, "vit-pytorch": vit_pytorch}
# Kept for tests/test_benchmark.py: every eager implementation by name.
IMPLS = {f"ours ({name})": ours(name) for name, p in PATHS.items() if not p.compiles}
IMPLS.update(PEER_BUILDERS)


def implementations(device: torch.device, compile_too: bool) -> dict[str, Callable]:
    """Name -> builder for every implementation that can run on ``device``."""
    impls = {}
    for name, path in PATHS.items():
        if path.unavailable(device) is None and (compile_too or not path.compiles):
            impls[f"ours ({name})"] = ours(name)
    impls.update(PEER_BUILDERS)
    if compile_too:
        for peer, builder in PEER_BUILDERS.items():
            impls[f"{peer} (compiled)"] = compiled_peer(builder)
    return impls


@dataclass
class Trainer:
    """One implementation ready to take training steps on a fixed batch."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    images: torch.Tensor
    labels: torch.Tensor
    device: torch.device
    bf16: bool

    def step(self) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = F.cross_entropy(self.model(self.images), self.labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def timed(self, steps: int) -> float:
        """Images/s over ``steps`` training steps (the device synchronised at both ends)."""
        sync(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        sync(self.device)
        return steps * len(self.images) / (time.perf_counter() - start)

    def memory_mb(self) -> float:
        """CUDA: peak allocated during one step; CPU: bytes saved for backward, in MB."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            self.step()
            sync(self.device)
            return (torch.cuda.max_memory_allocated(self.device) - base) / 2**20
        saved = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal saved
            saved += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            self.step()
        return saved / 2**20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(builder, arch: dict, device: torch.device, bf16: bool, batch: int) -> Trainer:
    torch.manual_seed(0)
    model = builder(**arch).to(device).train()
    g = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 1, IMG, IMG, generator=g).to(device)
    labels = torch.randint(0, CLASSES, (batch,), generator=g).to(device)
    # The same optimizer for every implementation: AdamW's fused kernel (our trainer's).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return Trainer(model, optimizer, images, labels, device, bf16)


def auto_choice(arch: dict, device: torch.device, bf16: bool, batch: int, compiled: bool):
    """What ``speed.path=auto`` picks here at this precision, with ``speed.compile`` set to
    ``compiled``."""
    return choose(
        reference_vit(**arch),
        device=device,
        batch_size=batch,
        precision="bf16-mixed" if bf16 else "32-true",
        include_compiled=compiled,
    )


def paired_ratio(a: list[float], b: list[float]) -> float:
    """The median over the repetitions of ``a``'s images/s over ``b``'s, pair by pair."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


@dataclass
class Row:
    """One implementation's figures in one run: every repetition's images/s, and the
    faster peer's in the same repetitions."""

    images_per_s: list[float]
    best_peer: list[float]
    memory_mb: float

    @property
    def speed(self) -> float:
        """Median images/s over the repetitions."""
        return statistics.median(self.images_per_s)

    @property
    def ratio(self) -> float:
        """Over the faster peer, repetition by repetition (:func:`paired_ratio`)."""
        return paired_ratio(self.images_per_s, self.best_peer)


def run_row(device, bf16, arch, *, batch, steps, reps, warmup, compile_too, warmup_s):
    """``{implementation: Row}`` for one device/precision/arch, with an ``ours (auto,
    ...: PATH)`` row for each setting's choice, and what ``auto`` chose. ``warmup_s``
    receives each implementation's warm-up seconds (for a compiled model, mostly
    compilation).

    An ``auto`` row is the row of the path it chose, the same trained model: ``auto``
    decides which path trains, and that path's row measures it. A second model on the same
    path, built later in the process, measured as much where ``malloc`` had placed its
    memory as the choice: up to 14% apart from the path's own row (docs/speed.md). A path
    with no row of its own here (a compiled one, where this run leaves them out) gets one.
    """
    trainers = {}

    def add(name: str, builder) -> None:
        trainers[name] = trainer = build(builder, arch, device, bf16, batch)
        sync(device)
        start = time.perf_counter()
        for _ in range(warmup):
            trainer.step()
        sync(device)
        warmup_s[name] = time.perf_counter() - start

    for name, builder in implementations(device, compile_too).items():
        try:
            add(name, builder)
        except Exception as e:
            # torch.compile of a peer can fail inside inductor on some torch versions (seen:
            # torch 2.11 on CUDA, an assertion in its tiling at patch 7): that row is left
            # out, not the run. Ours failing is a bug to see, so it still stops the run.
            if not name.endswith("(compiled)"):
                raise
            trainers.pop(name, None)
            warmup_s[name] = f"failed ({type(e).__name__}), row left out"
            print(f"warning: {name} left out: {type(e).__name__}: {e}"[:300], file=sys.stderr)
    # auto as a default run chooses; and, where this architecture has compiled rows, with
    # speed.compile=true (the rows above compiled it, so auto's own compiles take seconds).
    choices = {"auto": auto_choice(arch, device, bf16, batch, compiled=False)}
    if compile_too:
        choices["auto, speed.compile=true"] = auto_choice(arch, device, bf16, batch, True)
    for choice in choices.values():
        if f"ours ({choice.path})" not in trainers:
            add(f"ours ({choice.path})", ours(choice.path))
    speeds: dict[str, list[float]] = {name: [] for name in trainers}
    for rep in range(reps):
        for name in list(trainers)[:: 1 if rep % 2 == 0 else -1]:
            speeds[name].append(trainers[name].timed(steps))
    best_peer = [max(speeds[p][i] for p in PEERS) for i in range(reps)]
    rows = {name: Row(speeds[name], best_peer, t.memory_mb()) for name, t in trainers.items()}
    for setting, choice in choices.items():
        rows[f"ours ({setting}: {choice.path})"] = rows[f"ours ({choice.path})"]
    return rows, choices


def hardware_title(cuda: bool) -> str:
    """The section title: the hardware class this run measured."""
    if cuda:
        return f"GPU: {torch.cuda.get_device_name()}"
    forced = [
        f"{k}={os.environ[k]}"
        for k in (
            "ATEN_CPU_CAPABILITY",
            "ONEDNN_MAX_CPU_ISA",
            "MKL_ENABLE_INSTRUCTIONS",
            "TORCHINDUCTOR_CPP_MARCH",
        )
        if os.environ.get(k)
    ]
    title = f"CPU: {cpu_name()}, class {isa_class()}"
    if forced:
        title += f" (emulated: {' '.join(forced)} on an {cpu_class()} CPU)"
    return title


def versions_line() -> str:
    parts = [
        f"{torch.get_num_threads()} threads",
        f"torch {torch.__version__}",
        f"Python {platform.python_version()}",
    ]
    try:
        import timm
        import vit_pytorch

        parts.append(f"timm {timm.__version__}, vit-pytorch {vit_pytorch.__version__}")
    except (ImportError, AttributeError):
        pass
    return "; ".join(parts)


def markdown_section(results, choices, args, cuda: bool, warmups: dict) -> str:
    command = (
        " ".join(["python scripts/benchmark.py", *sys.argv[1:]])
        if args.argv is None
        else (" ".join(["python scripts/benchmark.py", *args.argv]))
    )
    lines = [
        f"## {hardware_title(cuda)}; patch {PATCH}",
        "",
        f"`{command}`; {versions_line()}.",
        "",
        f"Batch {args.batch}, fused AdamW, median of {args.reps} repetitions of {args.steps} "
        "training steps after warm-up, implementations interleaved in one process. "
        "Ratio: the median, repetition by repetition, of images/s over the faster of timm and "
        "vit-pytorch in that repetition. Memory: CUDA peak allocated "
        "per step; CPU: activations saved for backward. `ours (auto: PATH)` is the "
        "path `speed.path=auto` chose in this run with the default `speed.compile=false`; "
        "`ours (auto, speed.compile=true: PATH)` its choice when the compiled paths are "
        "timed too. Each `auto` row repeats the row of the path "
        "it chose: the same model.",
        "",
        "| precision | architecture | implementation | images/s | ratio to best peer "
        "| memory (MB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (row, arch), per_impl in results.items():
        for name, r in per_impl.items():
            lines.append(
                f"| {row} | {arch} | {name} | {r.speed:,.0f} | {r.ratio:.2f} | {r.memory_mb:,.1f} |"
            )
    lines += [
        "",
        "`auto` against the fastest single path of ours in the same run (the median, "
        "repetition by repetition, of its images/s over the fastest's):",
        "",
    ]
    for (row, arch), per_impl in results.items():
        singles = {n: r for n, r in per_impl.items() if n.startswith("ours (") and ":" not in n}
        fastest = max(singles, key=lambda n: singles[n].speed)
        autos = [
            f"{n[len('ours (') : -1]} "
            f"{paired_ratio(r.images_per_s, singles[fastest].images_per_s):.2f}x"
            for n, r in per_impl.items()
            if n.startswith("ours (auto")
        ]
        lines.append(f"- {row}, {arch}: fastest {fastest}; " + ", ".join(autos))
    lines += ["", "What `auto` measured in its own few steps (images/s) and the time it took:", ""]
    for (row, arch), per_setting in choices.items():
        for setting, choice in per_setting.items():
            figures = ", ".join(f"{k} {v:,.0f}" for k, v in choice.images_per_s.items())
            lines.append(
                f"- {row}, {arch}, {setting}: **{choice.path}** in {choice.seconds:.1f} s"
                f" ({figures})"
            )
    compiled = [
        (row, arch, name, secs)
        for (row, arch), per_impl in warmups.items()
        for name, secs in per_impl.items()
        if "compile" in name
    ]
    if compiled:
        lines += [
            "",
            f"Warm-up ({args.warmup} steps) of the compiled implementations, mostly "
            "torch.compile's compilation (shorter with a warm on-disk cache):",
            "",
            "| precision | architecture | implementation | warm-up (s) |",
            "| --- | --- | --- | --- |",
        ]
        lines += [
            f"| {r} | {a} | {n} | {s if isinstance(s, str) else f'{s:.1f}'} |"
            for r, a, n, s in compiled
        ]
    return "\n".join(lines) + "\n"


HEADER = """# Training throughput: vit-mnist against timm and vit-pytorch

Written by `scripts/benchmark.py`, one section per hardware class and patch size measured
(each run replaces its own section), and by `scripts/train_vs_peers.py` (the sections
"python train.py against the peers": the default training run, Lightning and data
included, against the peers' plain loop, pair by pair). Every row of ours trains the same model
(`vit_mnist/models`); the speed path in brackets is how the step is computed
(`vit_mnist/speed`, docs/speed.md).
"""


def merge(existing: str, section: str) -> str:
    """``existing`` with the section of the same title replaced by ``section`` (or added)."""
    title = section.splitlines()[0]
    parts = re.split(r"(?m)^(?=## )", existing)
    body = [p for p in parts[1:] if p.splitlines()[0] != title]
    return HEADER + "\n" + "\n".join(p.rstrip() + "\n" for p in [*body, section])


def main(argv: list[str] | None = None) -> int:
    global PATCH
    args = build_parser().parse_args(argv)
    args.argv = argv
    PATCH = args.patch
    try:
        import timm  # noqa: F401
        import vit_pytorch  # noqa: F401
    except ImportError as e:
        print(f"error: {e.name} is missing: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    bf16 = args.bf16 == "yes" or (args.bf16 == "auto" and has_native_bf16(cuda))
    rows = [("fp32", False)] + ([("bf16 autocast", True)] if bf16 else [])
    results, choices, warmups = {}, {}, {}
    for row, use_bf16 in rows:
        for arch_name in args.archs:
            label = arch_label(arch_name)
            warmups[(row, label)] = {}
            per_impl, choice_of = run_row(
                device,
                use_bf16,
                ARCHS[arch_name],
                batch=args.batch,
                steps=args.steps,
                reps=args.reps,
                warmup=args.warmup,
                compile_too=arch_name in args.compile_archs,
                warmup_s=warmups[(row, label)],
            )
            results[(row, label)], choices[(row, label)] = per_impl, choice_of
            summary = ", ".join(f"{n} {r.speed:,.0f} ({r.ratio:.2f}x)" for n, r in per_impl.items())
            print(f"{row} | {label}: {summary}", flush=True)
    section = markdown_section(results, choices, args, cuda, warmups)
    if args.out == "-":
        print(section)
        return 0
    from vit_mnist.io import atomic_write_bytes

    out = Path(args.out)
    existing = out.read_text() if out.exists() else ""
    atomic_write_bytes(out, merge(existing, section).encode())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
