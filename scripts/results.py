"""Markdown results table (and the heads plot) from training run dirs.

python scripts/results.py outputs/mnist_best/multiruns/<time> outputs/fashion_best/multiruns/<time>
python scripts/results.py outputs/heads_sweep/multiruns/<time> --plot docs/heads_sweep.png

Runs that differ only in `seed` make one row: test accuracy as mean +- std over the seeds.
The table goes to stdout (or --out FILE); the README's results section is this output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vit_mnist.results import find_failed, find_runs, group_rows, heads_plot, markdown_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run or multirun dirs")
    parser.add_argument("--out", type=Path, help="write the table here instead of stdout")
    parser.add_argument("--plot", type=Path, help="PNG of test accuracy against num_heads")
    parser.add_argument("--title", default="heads sweep", help="title of the plot")
    args = parser.parse_args(argv)
    try:
        rows = group_rows(find_runs(args.run_dirs))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = markdown_table(rows)
    failed = find_failed(args.run_dirs)
    if failed:
        table += f"\n{len(failed)} failed job(s), not in the table:\n\n"
        table += "".join(f"- `{run_dir}`: {message}\n" for run_dir, message in failed)
    if args.out:
        args.out.write_text(table)
    else:
        print(table, end="")
    if args.plot:
        heads = {row.first["model"]["num_heads"] for row in rows}
        if len(heads) < 2:
            print(f"error: --plot needs runs with several num_heads, got {heads}", file=sys.stderr)
            return 2
        heads_plot(rows, args.plot, args.title)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
