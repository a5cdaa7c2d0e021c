"""`python train.py` against timm and vit-pytorch in a plain training loop, taking turns.

    python scripts/train_vs_peers.py [--pairs 5] [--epochs 2] [--peer-seconds S] [--out FILE]
        [-- train.py overrides ...]

Each pair runs, in processes of their own and in alternating order:

1. ``python train.py`` with the overrides given, ``trainer.max_epochs=EPOCHS`` and no test,
   read back as ``train_images_per_s`` from its ``metrics.json`` (the training loop with
   Lightning, data and augmentation, validation left out; ``speed.path=auto`` chooses as it
   does for any run and, from the second run on, reads its cache);
2. the faster of timm and vit-pytorch in a plain loop (forward, cross-entropy, backward,
   fused AdamW; ``scripts/benchmark.py``'s loop, with ``malloc`` as it is), at the run's
   architecture, batch and precision (bf16 autocast where the run trained in bf16-mixed):
   repetitions of ``--steps`` steps, the two peers interleaved, at least ``--reps`` of them
   and by default for as long as the pair's ``train.py`` run trained (its
   ``train_time_s``); each peer's figure is its images over its seconds in them all, as
   ``train_images_per_s`` is the run's.

The ratio is taken pair by pair (images/s of the run over the faster peer), because one
comparison between moments minutes apart measures the machine as much as the code: on a
shared 2-core VM the same step can run at two speeds a third apart for minutes at a time,
ours and the peers' alike (docs/speed.md). For the same reason the peers run as long as the
run: a few seconds of them against a 20-epoch run compared the run's mix of fast and slow
stretches with whichever stretch those seconds fell in. ``--out`` writes a section per CPU
class to that Markdown file (replacing the same class's), as ``scripts/benchmark.py`` does.
"""

# ruff: noqa: E402 - torch and the benchmark are imported once --help has had its answer

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    """The command line; built before torch is imported, so that --help answers at once."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2, help="train.py's trainer.max_epochs")
    parser.add_argument("--steps", type=int, default=10, help="peer steps per repetition")
    parser.add_argument("--reps", type=int, default=5, help="peer repetitions, at least")
    parser.add_argument(
        "--peer-seconds",
        type=float,
        default=None,
        help="seconds the peers' loop runs at least (default: as long as the pair's train.py "
        "run trained, its train_time_s)",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed peer steps first")
    parser.add_argument("--out", default="-", help="Markdown file to add the section to, or -")
    parser.add_argument("--peers-only", metavar="SPEC", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="train.py's Hydra overrides")
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help (or a bad flag) answers here, before the imports

import benchmark as bench
import speedrun
import torch

ROOT = Path(__file__).resolve().parents[1]


def peer_arch(metrics: dict) -> dict:
    """The benchmark's architecture arguments (and ``patch``, ``batch``, ``bf16``) of the
    model and batch a ``train.py`` run's ``metrics.json`` records.

    Raises:
        ValueError: a model the peers cannot build as the same architecture (a causal
            mask; other than 28 x 28 single-channel images and 10 classes).
    """
    model = metrics["model"]
    if (model["img_size"], model["in_chans"], model["num_classes"]) != (
        bench.IMG,
        1,
        bench.CLASSES,
    ):
        raise ValueError(
            f"the run's model takes {model['in_chans']} x {model['img_size']}^2 images and "
            f"{model['num_classes']} classes; the peers are built for 1 x {bench.IMG}^2 "
            f"and {bench.CLASSES}: compare on MNIST-style data"
        )
    if model.get("causal"):
        raise ValueError("model.causal=true: the peers have no causal mask; compare without it")
    return {
        "embed_dim": model["embed_dim"],
        "depth": model["depth"],
        "num_heads": model["num_heads"],
        "mlp_dim": round(model["embed_dim"] * model["mlp_ratio"]),
        "patch": model["patch_size"],
        "batch": metrics["effective_batch_size"],
        "bf16": str(metrics["precision"]).startswith("bf16"),
    }


def time_peers(
    spec: dict, steps: int, reps: int, warmup: int, seconds: float = 0.0
) -> dict[str, float]:
    """Images/s of each peer (``spec`` as :func:`peer_arch` returns it) on the CPU, over
    interleaved repetitions of ``steps`` steps: at least ``reps`` of them, and more until
    ``seconds`` have passed. A peer's figure is its images over its seconds in them all."""
    bench.PATCH = spec["patch"]
    arch = {k: spec[k] for k in ("embed_dim", "depth", "num_heads", "mlp_dim")}
    device = torch.device("cpu")
    loops = {
        name: bench.build(builder, arch, device, spec["bf16"], spec["batch"])
        for name, builder in bench.PEER_BUILDERS.items()
    }
    for loop in loops.values():
        for _ in range(warmup):
            loop.step()
    spent = dict.fromkeys(loops, 0.0)
    start, rep = time.perf_counter(), 0
    while rep < reps or time.perf_counter() - start < seconds:
        for name in list(loops)[:: 1 if rep % 2 == 0 else -1]:
            spent[name] += steps * spec["batch"] / loops[name].timed(steps)
        rep += 1
    return {name: rep * steps * spec["batch"] / s for name, s in spent.items()}


def run_peers(spec: dict, args: argparse.Namespace, seconds: float) -> dict[str, float]:
    """:func:`time_peers` in a process of its own (a fresh plain loop, as a user runs it)."""
    cmd = [
        sys.executable,
        __file__,
        "--peers-only",
        json.dumps(spec),
        *("--steps", str(args.steps), "--reps", str(args.reps), "--warmup", str(args.warmup)),
        *("--peer-seconds", str(seconds)),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the peers' loop failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown_section(
    pairs: list[dict],
    command: str,
    overrides: list[str],
    epochs: int,
    peers_for: str = "for as long as the pair's run trained (its `train_time_s`)",
) -> str:
    """The section for ``--out``: one row per pair, then the median ratio. ``peers_for``
    says how long the peers' loop ran."""
    spec = pairs[0]["spec"]
    run = " ".join(["python train.py", *overrides])
    precision = "bf16 autocast" if spec["bf16"] else "fp32"
    lines = [
        f"## {bench.hardware_title(cuda=False)}; python train.py against the peers",
        "",
        f"`{command}`; {bench.versions_line()}.",
        "",
        f"`{run}` ({epochs} epoch{'s' if epochs != 1 else ''}, no test): patch "
        f"{spec['patch']}, embed_dim "
        f"{spec['embed_dim']}, depth {spec['depth']}, {spec['num_heads']} heads, MLP "
        f"{spec['mlp_dim']}, batch {spec['batch']}; `train_images_per_s` from its "
        "`metrics.json` (Lightning, data and augmentation included, validation left out), "
        "and its `qkv` bias if configured (the default; the peers' have none). "
        f"Peers: a plain loop in a process of its own, {precision}, `malloc` as it is, "
        f"interleaved repetitions {peers_for}, each peer's images over its seconds. Each pair "
        "in turn, the order alternating; ratio: the run over the faster peer of its pair.",
        "",
        "| pair | train.py images/s | its epochs | path, precision | timm | vit-pytorch | ratio |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, p in enumerate(pairs):
        m = p["metrics"]
        epochs = ", ".join(f"{r:,.0f}" for r in m.get("train_images_per_s_by_epoch") or [])
        lines.append(
            f"| {i + 1} | {m['train_images_per_s']:,.0f} | {epochs} | {m['speed_path']}, "
            f"{m['precision']} | {p['peers']['timm']:,.0f} | {p['peers']['vit-pytorch']:,.0f} "
            f"| {p['ratio']:.2f} |"
        )
    ratios = [p["ratio"] for p in pairs]
    lines += [
        "",
        f"Median ratio **{statistics.median(ratios):.2f}x** (pairs {min(ratios):.2f}x to "
        f"{max(ratios):.2f}x).",
        "",
    ]
    return "\n".join(lines)


def run_pairs(args: argparse.Namespace) -> list[dict]:
    """``args.pairs`` pairs of a ``train.py`` run and the peers' loop, each printed as it
    ends: ``{"metrics", "peers", "spec", "ratio"}`` per pair.

    Raises:
        RuntimeError: ``train.py`` or the peers' loop failed (its stderr's end included).
        ValueError: the run's model is one the peers cannot match (:func:`peer_arch`).
    """
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        spec, train_s = None, 0.0
        for i in range(args.pairs):
            figures: dict = {}
            # The first pair starts with train.py: its metrics give the peers' precision.
            for side in ("train", "peers") if i % 2 == 0 or spec is None else ("peers", "train"):
                if side == "train":
                    run = [f"trainer.max_epochs={args.epochs}", "test=false", *args.overrides]
                    m = speedrun.run_train_py(Path(tmp) / str(i), run)
                    spec = spec or peer_arch(m)
                    figures["metrics"] = m
                    train_s = float(m.get("train_time_s") or 0.0)
                else:
                    # As long as this pair's run trained, or where the peers go first, the
                    # last pair's: the runs of one comparison are the same length.
                    seconds = train_s if args.peer_seconds is None else args.peer_seconds
                    figures["peers"] = run_peers(spec, args, seconds)
            figures["spec"] = spec
            figures["ratio"] = figures["metrics"]["train_images_per_s"] / max(
                figures["peers"].values()
            )
            pairs.append(figures)
            m, peers = figures["metrics"], figures["peers"]
            print(
                f"pair {i + 1}: train.py {m['train_images_per_s']:,.0f} images/s "
                f"({m['speed_path']}, {m['precision']}), timm {peers['timm']:,.0f}, "
                f"vit-pytorch {peers['vit-pytorch']:,.0f}: {figures['ratio']:.2f}x",
                flush=True,
            )
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("pairs", "epochs", "steps", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)}: give 1 or more")
    if args.peer_seconds is not None and not args.peer_seconds >= 0:
        parser.error(f"--peer-seconds={args.peer_seconds:g}: give 0 or more")
    try:
        import timm  # noqa: F401
        import vit_pytorch  # noqa: F401
    except ImportError as e:
        print(f"error: {e.name} is missing: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    if args.peers_only:
        spec = json.loads(args.peers_only)
        peers = time_peers(spec, args.steps, args.reps, args.warmup, args.peer_seconds or 0.0)
        print(json.dumps(peers))
        return 0
    if torch.cuda.is_available():
        print("error: this compares CPU runs; on a GPU use scripts/gpu_check.py", file=sys.stderr)
        return 2
    try:
        pairs = run_pairs(args)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = " ".join(["python scripts/train_vs_peers.py", *(argv or sys.argv[1:])])
    kwargs = {}
    if args.peer_seconds is not None:
        kwargs["peers_for"] = f"for at least {args.peer_seconds:g} s and {args.reps} of them"
    section = markdown_section(pairs, command, args.overrides, args.epochs, **kwargs)
    if args.out == "-":
        print(section)
        return 0
    from vit_mnist.io import atomic_write_bytes

    out = Path(args.out)
    existing = out.read_text() if out.exists() else ""
    atomic_write_bytes(out, bench.merge(existing, section).encode())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
