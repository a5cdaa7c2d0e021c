"""Markdown results table (and the heads sweep's tables and plots) from training run dirs.

python scripts/results.py outputs/mnist_best/multiruns/<time> outputs/fashion_best/multiruns/<time>
python scripts/results.py outputs/heads_sweep/multiruns/<time> --plot docs/heads_sweep.png
python scripts/results.py outputs/heads_sweep/multiruns/<time> --analyse-heads \
    --heads-report docs/results.md

Runs that differ only in `seed` make one row: test accuracy as mean +- std over the seeds.
The table goes to stdout (or --out FILE); the README's results section is this output.

--analyse-heads runs `python eval.py analysis=heads` on each run's best checkpoint (into
<run dir>/heads/, skipped where it is there already): per head the accuracy drop when it
is zeroed, on the first 2 000 test images (--heads-test-fraction), its attention entropy
and mean attention distance (on the first 1 000). --heads-report then writes
the heads table, docs/heads_sweep.png (accuracy) and docs/heads_sweep_heads.png (per head)
into the given Markdown file, between the markers HEADS_START and HEADS_END.

--analyse-roles runs `python eval.py analysis=roles` on each run's best checkpoint (into
<run dir>/roles/, on the same share of the test set), and --roles-report writes, per token
count, the accuracy table and, per layer, the spread of the heads' role figures into the
given Markdown file, between ROLES_START and ROLES_END:
python scripts/results.py outputs/heads_sweep_p4 outputs/heads_sweep_p7 --analyse-roles \
    --roles-report docs/results.md

--analyse-circuits runs `python eval.py analysis=circuits` on each run's best checkpoint
(into <run dir>/circuits/, on the whole test set), and --circuits-report writes one line
per token and head count of what the heads write (scripts.results_tables.circuit_figures)
between CIRCUITS_START and CIRCUITS_END:
python scripts/results.py outputs/heads_sweep_p4 outputs/heads_sweep_p7 --analyse-circuits \
    --circuits-report docs/circuits.md
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# `python scripts/results.py` puts scripts/ on the path, not the checkout that holds the
# package scripts/ and its results_tables.py.
sys.path.insert(0, str(ROOT))

from scripts.results_tables import (  # noqa: E402
    CIRCUITS_FILE,
    HEADS_FILE,
    ROLES_FILE,
    Row,
    circuits_table,
    find_failed,
    find_runs,
    group_rows,
    heads_plot,
    heads_sweep_figure,
    heads_sweep_table,
    markdown_table,
    patch_tokens,
    proxy_table,
    roles_table,
    runs_table,
)
from vit_mnist.io import atomic_write_bytes  # noqa: E402

HEADS_START = "<!-- heads sweep: written by scripts/results.py --heads-report -->"
HEADS_END = "<!-- end of the heads sweep -->"
ROLES_START = "<!-- head roles: written by scripts/results.py --roles-report -->"
ROLES_END = "<!-- end of the head roles -->"
CIRCUITS_START = "<!-- circuits: written by scripts/results.py --circuits-report -->"
CIRCUITS_END = "<!-- end of the circuits -->"
ANALYSIS_FILES = {"heads": HEADS_FILE, "roles": ROLES_FILE, "circuits": CIRCUITS_FILE}


def analyse_heads(runs, test_fraction: float, analysis: str = "heads") -> None:
    """``eval.py analysis=heads`` (or ``roles``, ``circuits``) on every run's best checkpoint
    that has no such analysis yet, on the first ``test_fraction`` of the test set (heads
    and roles zero each head in turn, and each time the test images are run again: 96
    times for 16 heads in 6 blocks)."""
    for run in runs:
        if (run.path / ANALYSIS_FILES[analysis]).is_file():
            continue
        # By name inside the run dir: the absolute path in metrics.json is stale once a
        # run dir has been moved or copied.
        name = Path(run.metrics.get("best_ckpt") or "last.ckpt").name
        ckpt = run.path / "checkpoints" / name
        print(f"analysis={analysis} of {ckpt}", file=sys.stderr, flush=True)
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "eval.py"),
                f"ckpt_path={ckpt}",
                f"analysis={analysis}",
                f"trainer.limit_test_batches={test_fraction}",
                f"hydra.run.dir={run.path / analysis}",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )


def write_heads_report(rows, report: Path) -> None:
    """Put the heads table and plots into ``report`` between the markers (appended once)."""
    accuracy_png = report.parent / "heads_sweep.png"
    heads_png = report.parent / "heads_sweep_heads.png"
    heads_plot(rows, accuracy_png, "heads sweep: test accuracy")
    heads_sweep_figure(rows, heads_png)
    section = "\n".join(
        [
            HEADS_START,
            "",
            heads_sweep_table(rows).rstrip(),
            "",
            f"![Test accuracy against the number of heads]({accuracy_png.name})",
            "",
            f"![Entropy, distance and importance of every head]({heads_png.name})",
            "",
            HEADS_END,
        ]
    )
    replace_section(report, section, HEADS_START, HEADS_END)


def write_roles_report(rows, report: Path) -> None:
    """Put, per token count, the accuracy table, then the per-layer role figures into
    ``report`` between the roles markers (appended once). Rows of one model shape that
    ran with other thread counts (other ``device`` lines) are one row here: the report
    compares shapes, not machines."""
    shapes: dict[tuple, Row] = {}
    for row in rows:
        key = (row.runs[0].command(), row.first.get("dataset"))
        shapes.setdefault(key, Row()).runs.extend(row.runs)
    by_tokens: dict[int, list] = {}
    for row in shapes.values():
        by_tokens.setdefault(patch_tokens(row), []).append(row)
    rows = list(shapes.values())
    parts = [ROLES_START, ""]
    for tokens, group in sorted(by_tokens.items()):
        patch = group[0].first["model"]["patch_size"]
        parts += [
            f"Patch {patch}, {tokens} patch tokens:",
            "",
            heads_sweep_table(group).rstrip(),
            "",
        ]
    parts += ["Each run:", "", runs_table(rows).rstrip(), ""]
    parts += [roles_table(rows).rstrip(), "", ROLES_END]
    replace_section(report, "\n".join(parts), ROLES_START, ROLES_END)


def write_circuits_report(rows, report: Path) -> None:
    """Put the circuits table (:func:`scripts.results_tables.circuits_table`) into ``report``
    between the circuits markers (appended once)."""
    section = "\n".join([CIRCUITS_START, "", circuits_table(rows).rstrip(), "", CIRCUITS_END])
    replace_section(report, section, CIRCUITS_START, CIRCUITS_END)


def replace_section(report: Path, section: str, start: str, end: str) -> None:
    """``section`` in place of the text between ``start`` and ``end`` in ``report``, or
    appended when the markers are not there."""
    text = report.read_text() if report.exists() else ""
    if start in text and end in text:
        before, _, rest = text.partition(start)
        text = before + section + rest.partition(end)[2]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    atomic_write_bytes(report, text.encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run or multirun dirs")
    parser.add_argument("--out", type=Path, help="write the table here instead of stdout")
    parser.add_argument("--plot", type=Path, help="PNG of test accuracy against num_heads")
    parser.add_argument("--title", default="heads sweep", help="title of the plot")
    parser.add_argument(
        "--proxy-report",
        action="store_true",
        help="print whether the validation accuracy after a quarter and a half of each run "
        "(and with --proxy-runs, short runs of the same names) ranks the runs as their full "
        "length does (a study's proxy check)",
    )
    parser.add_argument(
        "--proxy-runs",
        type=Path,
        help="a folder of short runs, each named as its full run (a study's trials, with "
        "test=false, count), for the --proxy-report table (which it implies)",
    )
    parser.add_argument(
        "--default-run",
        type=Path,
        help="a default `python train.py` run dir on the same machine, the same day: each "
        "row's fitting time over its (the CPU recipes' budget is at most 8x)",
    )
    parser.add_argument(
        "--analyse-heads", action="store_true", help="run eval.py analysis=heads on each run"
    )
    parser.add_argument(
        "--heads-test-fraction",
        type=float,
        default=0.2,
        help="share of the test set for --analyse-heads and --analyse-roles (default 0.2: "
        "the first 2 000 images)",
    )
    parser.add_argument("--heads-report", type=Path, help="Markdown file for the heads tables")
    parser.add_argument(
        "--analyse-roles", action="store_true", help="run eval.py analysis=roles on each run"
    )
    parser.add_argument("--roles-report", type=Path, help="Markdown file for the roles tables")
    parser.add_argument(
        "--analyse-circuits",
        action="store_true",
        help="run eval.py analysis=circuits on each run (the whole test set)",
    )
    parser.add_argument("--circuits-report", type=Path, help="Markdown file for the circuits table")
    args = parser.parse_args(argv)
    try:
        # A study's full runs that only rank on validation (test=false) count for the proxy
        # table; the results table takes the runs with a test reading.
        proxy_check = args.proxy_report or args.proxy_runs is not None
        runs = find_runs(args.run_dirs, tested=not proxy_check)
        default = find_runs([args.default_run])[0] if args.default_run else None
        proxies = find_runs([args.proxy_runs], tested=False) if args.proxy_runs else []
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = group_rows([run for run in runs if "test/acc" in run.metrics])
    table = markdown_table(rows, default) if rows else ""
    failed = find_failed(args.run_dirs)
    if failed:
        table += f"\n{len(failed)} failed job(s), not in the table:\n\n"
        table += "".join(f"- `{run_dir}`: {message}\n" for run_dir, message in failed)
    if args.out:
        args.out.write_text(table)
    else:
        print(table, end="")
    heads = {str(row.first["model"]["num_heads"]) for row in rows}
    if (args.plot or args.heads_report) and len(heads) < 2:
        print(f"error: the heads plots need several num_heads, got {heads}", file=sys.stderr)
        return 2
    if args.plot:
        heads_plot(rows, args.plot, args.title)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.proxy_report or proxies:
        print("\n" + proxy_table(runs, proxies), end="")
    if args.analyse_heads:
        analyse_heads(runs, args.heads_test_fraction)
    if args.heads_report:
        write_heads_report(rows, args.heads_report)
        print(f"wrote the heads sweep into {args.heads_report}", file=sys.stderr)
    if args.analyse_roles:
        analyse_heads(runs, args.heads_test_fraction, analysis="roles")
    if args.roles_report:
        write_roles_report(rows, args.roles_report)
        print(f"wrote the head roles into {args.roles_report}", file=sys.stderr)
    if args.analyse_circuits:
        analyse_heads(runs, 1.0, analysis="circuits")
    if args.circuits_report:
        write_circuits_report(rows, args.circuits_report)
        print(f"wrote the circuits into {args.circuits_report}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
