"""What choosing the speed path costs: seconds in ``speed.path=auto``'s choice before runs
that a user makes, each a fresh ``train.py`` process, on a fresh cache folder, then again
on the same folder (docs/speed.md, "What choosing costs").

python scripts/choice_cost.py                      # this checkout, idle: a Markdown table
python scripts/choice_cost.py --busy               # with `yes > /dev/null` beside each run
python scripts/choice_cost.py --repo ../old-clone  # another checkout (its .venv, or this python)

The runs: the default run (stopped once its ``speed path:`` line is printed), the README's
``num_heads=8`` example cut to 20 batches an epoch, a resume of a finished run (trained
first, 20 batches, ``speed.path=reference``), and a 4-job seed sweep of the default run,
each job stopped by ``+trainer.max_time`` after 10 s of training. A figure is the sum of
the seconds the ``speed path:`` lines give; a run still choosing after ``--timeout``
seconds is stopped and shown as ``> N``. Each run's log is kept under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The seconds of a choice as each version's line gives them (1909a78: "measured in").
SECONDS = re.compile(
    r"speed path: .*?\((?:measured in|measured now in|reused in|reused, its "
    r"leaders timed again now in|not timed \()\s*([0-9.]+) s"
)
NUM_HEADS_8 = [
    "model.num_heads=8",
    "model.embed_dim=128",
    "model.depth=4",
    "model.patch_size=7",
    "trainer=cpu",
    "trainer.max_epochs=3",
    "data.batch_size=256",
    "seed=7",
    "+trainer.limit_train_batches=20",
]
SWEEP = [
    "-m",
    "seed=0,1,2,3",
    "+trainer.max_time=00:00:00:10",
    "trainer.min_epochs=0",
    "test=false",
    "callbacks.attention_maps=null",
]


def run(
    repo: Path, args: list[str], cache: Path, log: Path, stop_at_choice: bool, timeout: float
) -> tuple[list[float], float, bool]:
    """``train.py args`` in ``repo`` with ``VIT_MNIST_CACHE=cache``, output in ``log``:
    the choice seconds of each ``speed path:`` line, the wall seconds, and whether it was
    stopped at ``timeout``."""
    python = repo / ".venv" / "bin" / "python"
    env = dict(os.environ, VIT_MNIST_CACHE=str(cache))
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(python if python.exists() else sys.executable), "train.py", *args],
            cwd=repo,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    timed_out = False
    while proc.poll() is None:
        text = log.read_text(errors="replace")
        if stop_at_choice and ("speed path:" in text or "error:" in text):
            break
        if time.perf_counter() - start > timeout:
            timed_out = True
            break
        time.sleep(0.1)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    seconds = [float(s) for s in SECONDS.findall(log.read_text(errors="replace"))]
    return seconds, time.perf_counter() - start, timed_out


def measure(repo: Path, out: Path, timeout: float) -> dict[str, list[str]]:
    """Each run on a fresh cache folder, then again on it: row name -> [first, repeated]."""
    cache = out / "cache"
    finished = out / "finished"
    run(
        repo,
        [
            "trainer.max_epochs=1",
            "+trainer.limit_train_batches=20",
            "test=false",
            "speed.path=reference",
            f"hydra.run.dir={finished}",
        ],
        out / "cache_finished",
        out / "finished.log",
        False,
        600,
    )
    resume = [
        f"ckpt_path={finished}/checkpoints/last.ckpt",
        "trainer.max_epochs=1",
        "+trainer.limit_train_batches=20",
        "test=false",
    ]
    runs = {
        "default run": ([], True),
        "num_heads=8 example, 20 batches": (NUM_HEADS_8, True),
        "resume of a finished run": (resume, False),
        "4-job sweep": (SWEEP, False),
    }
    rows: dict[str, list[str]] = {}
    for label in ("first", "repeated"):
        for i, (name, (args, stop)) in enumerate(runs.items()):
            where = (
                [f"hydra.sweep.dir={out}/{label}{i}"]
                if "-m" in args
                else [f"hydra.run.dir={out}/{label}{i}"]
            )
            seconds, wall, timed_out = run(
                repo, [*args, *where], cache, out / f"{label}{i}.log", stop, timeout
            )
            said = f"> {timeout:.0f}" if timed_out else f"{sum(seconds):.2f}"
            said += f" ({' + '.join(f'{s:.2f}' for s in seconds)})" if len(seconds) > 1 else ""
            rows.setdefault(name, []).append(f"{said}; {wall:.1f} s in all")
            print(f"{name}, {label}: {rows[name][-1]}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=ROOT, help="the checkout to run")
    parser.add_argument("--busy", action="store_true", help="run `yes > /dev/null` beside")
    parser.add_argument("--timeout", type=float, default=200, help="seconds a run may take")
    parser.add_argument("--out", type=Path, help="where the logs go (default: a temporary folder)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="choice_cost_"))
    out.mkdir(parents=True, exist_ok=True)
    hog = (
        subprocess.Popen(["sh", "-c", "yes > /dev/null"], start_new_session=True)
        if args.busy
        else None
    )
    try:
        rows = measure(args.repo.resolve(), out, args.timeout)
    finally:
        if hog is not None:
            os.killpg(hog.pid, signal.SIGKILL)
    print(f"\nSeconds choosing ({'busy' if args.busy else 'idle'}; logs in {out}):\n")
    print("| run | first | repeated |\n| --- | --- | --- |")
    for name, (first, repeated) in rows.items():
        print(f"| {name} | {first} | {repeated} |")


if __name__ == "__main__":
    main()
