"""Training-step throughput and memory: our ViT against timm's and vit-pytorch's.

python scripts/benchmark.py                      # writes docs/benchmarks.md
python scripts/benchmark.py --reps 5 --steps 10 --out -     # print only

Needs the `bench` extra (pip install -e '.[bench]': timm, vit-pytorch).

Every implementation is built with the same architecture (image 28, patch 4, 1 channel,
10 classes, class token, the same embed_dim, depth, heads and MLP width), trained with
AdamW on the same random batch at the same precision, in this one process. After warm-up
steps, the implementations take turns: each repetition times `--steps` training steps
(forward, cross-entropy, backward, fused AdamW step) of every implementation in turn, so a
drift in the machine's speed touches all of them alike. The table gives the median
images/s over the repetitions and each one's ratio to the faster peer.

Memory: on CUDA, the peak of torch.cuda.max_memory_allocated during a step; on the CPU,
where PyTorch keeps no such counter, the bytes autograd saves for the backward pass
(the activations, the bulk of a training step's memory), counted with
torch.autograd.graph.saved_tensors_hooks.

Differences that cannot be removed: vit-pytorch's patch embedding has a LayerNorm before
and after its Linear (two more LayerNorms than ours and timm's), and its QKV projection has
no bias; ours and timm's are built with qkv_bias=False to match the latter.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vit_mnist.models import EncoderBlock, MultiHeadSelfAttention, VisionTransformer
from vit_mnist.module import CompiledUnderSettings
from vit_mnist.utils import cpu_name

ARCHS = {
    # The default config's width, depth and heads at patch 4.
    "default (embed_dim 64, depth 6, 4 heads, MLP 128)": dict(
        embed_dim=64, depth=6, num_heads=4, mlp_dim=128
    ),
    "larger (embed_dim 192, depth 6, 6 heads, MLP 384)": dict(
        embed_dim=192, depth=6, num_heads=6, mlp_dim=384
    ),
}
PATCH, IMG, CLASSES = 4, 28, 10


def ours(impl: str, native_kernel: bool = True) -> Callable[..., nn.Module]:
    def build(embed_dim, depth, num_heads, mlp_dim):
        model = VisionTransformer(
            img_size=IMG,
            patch_size=PATCH,
            in_chans=1,
            num_classes=CLASSES,
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=mlp_dim / embed_dim,
            attention_impl=impl,
            qkv_bias=False,
        )
        for m in model.modules():
            if isinstance(m, MultiHeadSelfAttention | EncoderBlock | VisionTransformer):
                m.native_kernel = native_kernel
        return model

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


def compiled(build: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    # Every compiled model, ours and the peers', is called under our compile settings, as
    # model.compile=true calls ours: they change compile time, not the compiled speed.
    def build_compiled(**arch):
        return CompiledUnderSettings(build(**arch))

    return build_compiled


IMPLS = {
    "ours (explicit)": ours("explicit"),
    # The explicit path on PyTorch operations: what the fused CPU kernel adds.
    "ours (explicit, no kernel)": ours("explicit", native_kernel=False),
    "ours (fused)": ours("fused"),
    "timm": timm_vit,
    "vit-pytorch": vit_pytorch,
}
# torch.compile (inductor) of ours (attention_impl=auto: explicit on the CPU, fused on
# CUDA) and of both peers: what model.compile=true buys, and what it buys the others.
COMPILED = {
    "ours (auto, compiled)": compiled(ours("auto")),
    "timm (compiled)": compiled(timm_vit),
    "vit-pytorch (compiled)": compiled(vit_pytorch),
}
PEERS = ("timm", "vit-pytorch")


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


def build(name: str, arch: dict, device: torch.device, bf16: bool, batch: int) -> Trainer:
    torch.manual_seed(0)
    model = {**IMPLS, **COMPILED}[name](**arch).to(device).train()
    g = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 1, IMG, IMG, generator=g).to(device)
    labels = torch.randint(0, CLASSES, (batch,), generator=g).to(device)
    # The same optimizer for every implementation: AdamW's fused kernel (our trainer's).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return Trainer(model, optimizer, images, labels, device, bf16)


def run_row(
    device, bf16, arch, *, batch, steps, reps, warmup, compile_too: bool, warmup_s: dict
) -> dict[str, tuple[float, float]]:
    """``{implementation: (median images/s, memory MB)}`` for one device/precision/arch.

    ``warmup_s`` receives each implementation's warm-up seconds (for a compiled model,
    mostly compilation)."""
    names = list(IMPLS) + (list(COMPILED) if compile_too else [])
    trainers = {name: build(name, arch, device, bf16, batch) for name in names}
    for name, trainer in trainers.items():
        sync(device)
        start = time.perf_counter()
        for _ in range(warmup):
            trainer.step()
        sync(device)
        warmup_s[name] = time.perf_counter() - start
    speeds: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(reps):
        for name, trainer in trainers.items():
            speeds[name].append(trainer.timed(steps))
    return {
        name: (statistics.median(speeds[name]), trainers[name].memory_mb()) for name in trainers
    }


def hardware_line(cuda: bool) -> str:
    parts = [
        f"CPU: {cpu_name()}, {torch.get_num_threads()} threads",
        f"torch {torch.__version__}",
        f"Python {platform.python_version()}",
    ]
    if cuda:
        parts.insert(1, f"GPU: {torch.cuda.get_device_name()}")
    try:
        import timm
        import vit_pytorch

        parts.append(f"timm {timm.__version__}, vit-pytorch {vit_pytorch.__version__}")
    except (ImportError, AttributeError):
        pass
    return "; ".join(parts)


def markdown(results, args, cuda: bool, warmups: dict) -> str:
    lines = [
        "# Training throughput: vit-mnist against timm and vit-pytorch",
        "",
        "Written by `python scripts/benchmark.py "
        + f"--batch {args.batch} --steps {args.steps} --reps {args.reps} "
        + f"--compile-archs {' '.join(args.compile_archs)}`.".replace(" `", "`"),
        "",
        f"Hardware: {hardware_line(cuda)}.",
        "",
        f"Batch {args.batch}, fused AdamW, median of {args.reps} repetitions of {args.steps} "
        "training steps after warm-up, implementations interleaved in one process. "
        "Ratio: images/s over the faster of timm and vit-pytorch. Memory: CUDA peak allocated "
        "per step; CPU: activations saved for backward.",
        "",
        "| device, precision | architecture | implementation | images/s | ratio to best peer "
        "| memory (MB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (row, arch), per_impl in results.items():
        best_peer = max(per_impl[p][0] for p in PEERS)
        for name, (speed, mem) in per_impl.items():
            lines.append(
                f"| {row} | {arch} | {name} | {speed:,.0f} | {speed / best_peer:.2f} | {mem:,.1f} |"
            )
    compiled_rows = [
        (row, arch, name, secs)
        for (row, arch), per_impl in warmups.items()
        for name, secs in per_impl.items()
        if name in COMPILED
    ]
    if compiled_rows:
        lines += [
            "",
            f"Warm-up ({args.warmup} steps) of the compiled models, which is mostly "
            "torch.compile's compilation (eager models take well under a second), all "
            "three under `vit_mnist.module.compile_settings` as `model.compile=true` runs "
            "ours; a warm on-disk cache from an earlier run shortens it:",
            "",
            "| device, precision | architecture | implementation | warm-up (s) |",
            "| --- | --- | --- | --- |",
        ]
        lines += [f"| {r} | {a} | {n} | {s:.1f} |" for r, a, n, s in compiled_rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10, help="training steps per repetition")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--out", default="docs/benchmarks.md", help="Markdown file, or -")
    parser.add_argument(
        "--archs", nargs="+", choices=["default", "larger"], default=["default", "larger"]
    )
    parser.add_argument(
        "--compile-archs",
        nargs="*",
        choices=["default", "larger"],
        default=["default"],
        help="architectures that also get the torch.compile rows (compiling takes minutes)",
    )
    args = parser.parse_args(argv)
    try:
        import timm  # noqa: F401
        import vit_pytorch  # noqa: F401
    except ImportError as e:
        print(f"error: {e.name} is missing: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    rows = [
        ("CPU fp32", torch.device("cpu"), False),
        ("CPU bf16 autocast", torch.device("cpu"), True),
    ]
    if cuda:
        rows.append(("CUDA bf16 autocast", torch.device("cuda"), True))
    results, warmups = {}, {}
    for row, device, bf16 in rows:
        for arch_name, arch in ARCHS.items():
            if arch_name.split()[0] not in args.archs:
                continue
            warmups[(row, arch_name)] = {}
            per_impl = run_row(
                device,
                bf16,
                arch,
                batch=args.batch,
                steps=args.steps,
                reps=args.reps,
                warmup=args.warmup,
                compile_too=arch_name.split()[0] in args.compile_archs,
                warmup_s=warmups[(row, arch_name)],
            )
            results[(row, arch_name)] = per_impl
            best_peer = max(per_impl[p][0] for p in PEERS)
            summary = ", ".join(
                f"{n} {s:,.0f} ({s / best_peer:.2f}x)" for n, (s, _) in per_impl.items()
            )
            print(f"{row} | {arch_name}: {summary}", flush=True)
    text = markdown(results, args, cuda, warmups)
    if args.out == "-":
        print(text)
    else:
        from vit_mnist.data.sources import atomic_write_bytes

        atomic_write_bytes(Path(args.out), text.encode())
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
