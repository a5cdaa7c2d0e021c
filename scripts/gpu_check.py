"""Every CUDA path of the project on one GPU, in one command, with a Markdown report.

python scripts/gpu_check.py                      # writes outputs/gpu_check/<time>/gpu_check.md
python scripts/gpu_check.py --out DIR --speedrun-seeds 10
python scripts/gpu_check.py --speedrun-seeds 0   # steps 1 to 4 only

On a machine without CUDA it prints one line saying so and exits 0. With a GPU it runs,
in turn (each a fresh process, as a user would):

1. training on the GPU in bf16 with ``speed.path=auto`` (the speed layer's choice on CUDA,
   its timings in the report), the data kept on the GPU (``data.on_device``) and the
   attention maps callback on (2 epochs of the default recipe);
2. that GPU checkpoint evaluated on the CPU (``CUDA_VISIBLE_DEVICES=``), whose test
   accuracy must equal the GPU run's to 0.1 point;
3. the same checkpoint exported on the CPU (ONNX when the export extra is installed,
   else TorchScript) and compared with PyTorch on 1 000 test images;
4. the benchmark's CUDA rows against timm and vit-pytorch (``scripts/benchmark.py``,
   default architecture, fp32 and bf16);
5. the speedrun on one GPU, every seed (``scripts/speedrun.py --seeds N``).

Exit status 0 when every step passed, 1 when one failed (the report says which).
On one H100 (2026-11-24) steps 1 to 4 took 100 s together; the speedrun takes minutes a
seed (2 seeds had not finished after 5 minutes). The steps' wall times are in the report.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from vit_mnist.io import atomic_write_bytes

ROOT = Path(__file__).resolve().parents[1]
NO_CUDA = "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing to check"


@dataclass
class Step:
    """One command of the check and what it printed."""

    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    returncode: int | None = None
    wall_s: float = 0.0
    output: str = ""
    figures: list[str] = field(default_factory=list)

    def run(self) -> bool:
        start = time.perf_counter()
        proc = subprocess.run(
            self.command,
            cwd=ROOT,
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
        )
        self.wall_s = time.perf_counter() - start
        self.returncode = proc.returncode
        self.output = (proc.stdout + proc.stderr)[-4000:]
        return proc.returncode == 0


def steps(out: Path, speedrun_seeds: int) -> list[Step]:
    """The commands, in order; the later ones read the first one's checkpoint."""
    python = sys.executable
    train_dir = out / "train_gpu"
    best = f"$(best:{train_dir})"  # replaced once the training has run
    cpu = {"CUDA_VISIBLE_DEVICES": ""}
    checks = [
        Step(
            "train on the GPU: bf16, speed.path=auto, data on the GPU, attention maps",
            [
                python,
                "train.py",
                "trainer=gpu",
                "trainer.max_epochs=2",
                "trainer.precision=bf16-mixed",
                "speed.path=auto",
                "data.on_device=true",
                f"hydra.run.dir={train_dir}",
            ],
        ),
        Step(
            "the GPU checkpoint evaluated on the CPU",
            [python, "eval.py", f"ckpt_path={best}", f"hydra.run.dir={out / 'eval_cpu'}"],
            env=cpu,
        ),
        Step(
            "the GPU checkpoint exported on the CPU",
            [
                python,
                "scripts/export.py",
                f"ckpt_path={best}",
                f"format={'onnx' if _has_onnx() else 'torchscript'}",
                f"hydra.run.dir={out / 'export_cpu'}",
            ],
            env=cpu,
        ),
        Step(
            "benchmark: CUDA rows against timm and vit-pytorch",
            [
                python,
                "scripts/benchmark.py",
                "--archs",
                "default",
                "--compile-archs",
                "--out",
                str(out / "benchmark.md"),
            ],
        ),
        Step(
            f"speedrun on one GPU, {speedrun_seeds} seeds",
            [
                python,
                "scripts/speedrun.py",
                "--seeds",
                str(speedrun_seeds),
                "--out",
                str(out / "speedrun"),
                "trainer.accelerator=gpu",
            ],
        ),
    ]
    return checks if speedrun_seeds > 0 else checks[:-1]


def _has_onnx() -> bool:
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def _best_checkpoint(train_dir: Path) -> str:
    return json.loads((train_dir / "metrics.json").read_text())["best_ckpt"]


def _figures(step: Step, out: Path) -> list[str]:
    """The numbers the report shows for a finished step."""
    if step.name.startswith("train on the GPU"):
        m = json.loads((out / "train_gpu" / "metrics.json").read_text())
        timings = ", ".join(f"{k} {v:,.0f}" for k, v in m["speed_images_per_s"].items())
        return [
            f"device {m['device']}, precision {m['precision']}",
            f"speed path chosen: {m['speed_path']} (images/s timed: {timings})",
            f"test accuracy {100 * m['test/acc']:.2f}%, {m['train_images_per_s']:,.0f} "
            f"training images/s, fitting {m['fit_time_s']:.1f} s",
        ]
    if step.name.startswith("the GPU checkpoint evaluated"):
        gpu = json.loads((out / "train_gpu" / "metrics.json").read_text())["test/acc"]
        cpu = json.loads((out / "eval_cpu" / "metrics.json").read_text())["test/acc"]
        agree = abs(gpu - cpu) <= 0.001
        if not agree:
            step.returncode = 1
        return [f"test accuracy on the CPU {100 * cpu:.2f}% (GPU run: {100 * gpu:.2f}%)"]
    # The benchmark prints "fp32 | default (...): ..." per row, the speedrun a Markdown table.
    lines = [line for line in step.output.splitlines() if "|" in line or "seeds" in line]
    return lines[-16:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="report folder (default outputs/gpu_check/<time>)")
    parser.add_argument("--speedrun-seeds", type=int, default=10, help="0 leaves the speedrun out")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    out = args.out or ROOT / "outputs" / "gpu_check" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out.mkdir(parents=True, exist_ok=True)
    report = [
        f"# GPU check: {torch.cuda.get_device_name()}",
        "",
        f"`python scripts/gpu_check.py`, torch {torch.__version__}, "
        f"{datetime.now():%Y-%m-%d %H:%M}.",
        "",
    ]
    ok = True
    for step in steps(out, args.speedrun_seeds):
        if any("$(best:" in c for c in step.command):
            if not (out / "train_gpu" / "metrics.json").is_file():
                report += [f"## {step.name}", "", "not run: the GPU training failed", ""]
                ok = False
                continue
            best = _best_checkpoint(out / "train_gpu")
            step.command = [c.replace(f"$(best:{out / 'train_gpu'})", best) for c in step.command]
        print(f"gpu_check: {step.name} ...", flush=True)
        passed = step.run()
        if passed:
            try:
                step.figures = _figures(step, out)
            except (OSError, KeyError, ValueError) as e:
                step.figures, step.returncode = [f"cannot read the results: {e}"], 1
        passed = step.returncode == 0
        ok &= passed
        print(f"gpu_check: {'passed' if passed else 'FAILED'} in {step.wall_s:.0f} s", flush=True)
        report += [
            f"## {step.name}: {'passed' if passed else 'FAILED'} ({step.wall_s:.0f} s)",
            "",
            "```",
            " ".join(step.command).replace(str(ROOT) + "/", ""),
            "```",
            "",
            *(step.figures if passed else ["```", step.output[-2000:], "```"]),
            "",
        ]
        # After every step, so a check stopped part way keeps what it found.
        atomic_write_bytes(out / "gpu_check.md", "\n".join(report).encode())
    print(f"gpu_check: {'all steps passed' if ok else 'a step FAILED'}; report {out}/gpu_check.md")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
