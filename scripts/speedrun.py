"""Run `python train.py experiment=speedrun` for N seeds; print accuracy and fitting time.

python scripts/speedrun.py                      # seeds 1 to 5
python scripts/speedrun.py --seeds 10 trainer=gpu
python scripts/speedrun.py --seeds 3 -- trainer.max_epochs=8     # extra overrides

Each seed is a fresh `python train.py experiment=speedrun seed=S` process (its run dir is
<out>/seed_S). Per seed it prints the test accuracy of the final weights and the fitting
time: wall seconds from the start of the first training step to the end of the last
(`fit_time_s` in metrics.json; process start, data preparation and the final test are
left out), plus the whole command's wall time. Then the means, and whether every seed
reached --target. Exit status 0 when all did, 1 when one did not, 2 when a run failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from vit_mnist.io import write_metrics

ROOT = Path(__file__).resolve().parents[1]


def run_train_py(run_dir: Path, args: list[str], label: str = "python train.py") -> dict:
    """``python train.py hydra.run.dir=RUN_DIR ARGS`` in a fresh process; its metrics.json
    plus ``command_wall_s`` (the process's wall seconds, also added to that metrics.json).

    Raises:
        RuntimeError: the process failed: ``label``, its exit code and its stderr's last
            lines.
    """
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *args]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"{label} failed (exit {proc.returncode}): " + " | ".join(tail))
    # The whole command's clock goes into the run's own metrics.json too, where
    # scripts/results.py finds it for the results table.
    metrics = {**json.loads((run_dir / "metrics.json").read_text()), "command_wall_s": wall}
    write_metrics(run_dir / "metrics.json", metrics)
    return metrics


def run_seed(seed: int, out: Path, overrides: list[str]) -> dict:
    """Train one seed in a fresh process; its metrics.json plus ``command_wall_s``."""
    args = ["experiment=speedrun", f"seed={seed}", *overrides]
    return run_train_py(out / f"seed_{seed}", args, label=f"seed {seed}")


def _one_view(metrics: dict) -> str:
    """The accuracy of the unshifted images alone when the test averaged shifted copies
    (``module.test_time_shift``), else ``-``."""
    one_view = metrics.get("test/acc_one_view")
    return "-" if one_view is None else f"{100 * one_view:.2f}%"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="run seeds 1..N (default 5)")
    parser.add_argument("--target", type=float, default=0.99, help="test accuracy to reach")
    parser.add_argument(
        "--out", type=Path, help="folder of the run dirs (default outputs/speedrun/<time>)"
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every seed")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds={args.seeds} must be at least 1")
    out = args.out or ROOT / "outputs" / "speedrun" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    print(f"python train.py experiment=speedrun {' '.join(args.overrides)}  (runs in {out})")
    print("| seed | test accuracy | one view | fitting time (s) | epochs | whole command (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = []
    for seed in range(1, args.seeds + 1):
        try:
            m = run_seed(seed, out, args.overrides)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        rows.append(m)
        print(
            f"| {seed} | {100 * m['test/acc']:.2f}% | {_one_view(m)} | {m['fit_time_s']:.1f} "
            f"| {m['epochs']} "
            f"| {m['command_wall_s']:.1f} |",
            flush=True,
        )
    accs = [m["test/acc"] for m in rows]
    fits = [m["fit_time_s"] for m in rows]
    walls = [m["command_wall_s"] for m in rows]
    print(
        f"| mean | {100 * statistics.mean(accs):.2f}% | | {statistics.mean(fits):.1f} | "
        f"| {statistics.mean(walls):.1f} |"
    )
    reached = sum(a >= args.target for a in accs)
    print(
        f"{reached}/{len(accs)} seeds reached {100 * args.target:.1f}%; lowest "
        f"{100 * min(accs):.2f}%; device {rows[0]['device']}, speed path "
        f"{rows[0]['speed_path']}, precision {rows[0]['precision']}"
    )
    summary = {
        "runs": rows,
        "mean_test_acc": statistics.mean(accs),
        "mean_fit_s": statistics.mean(fits),
    }
    write_metrics(out / "speedrun.json", summary)  # atomic: never left half-written
    return 0 if reached == len(accs) else 1


if __name__ == "__main__":
    sys.exit(main())
