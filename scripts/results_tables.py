"""Results tables from run dirs: what ``scripts/results.py`` prints into the README.

Each run dir written by ``train.py`` holds ``metrics.json`` and ``.hydra/overrides.yaml``.
Runs that differ only in ``seed`` form one row: test accuracy as mean +- sample standard
deviation over the seeds, never the best seed.
"""

from __future__ import annotations

import csv
import json
import re
import shlex
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vit_mnist.errors import FAILED_FILE

DATASET_NAMES = {"mnist": "MNIST", "fashion_mnist": "Fashion-MNIST", "synthetic": "synthetic"}


@dataclass
class Run:
    """One finished training run: its directory, ``metrics.json`` and command-line overrides."""

    path: Path
    metrics: dict[str, Any]
    overrides: list[str]
    # Position of the path it was found under, among the paths given: rows keep that order.
    source_index: int = 0

    @property
    def seed(self) -> int:
        return int(self.metrics["seed"])

    def device(self) -> str:
        """``metrics.json``'s device line, with the CPU class (AVX2, AVX512-BF16, ...) that
        runs from before it was recorded there have only in their log's speed line."""
        device = str(self.metrics.get("device"))
        if not device.startswith("cpu (") or re.search(r"AVX|AMX|ARM", device):
            return device
        for log in sorted(self.path.glob("*.log")):
            found = re.search(r"speed path: .*?\(.*?\((AMX|AVX[\w-]*|ARM[^)]*)\)", log.read_text())
            if found:
                return device.replace(", ", f", {found.group(1)}, ", 1)
        return device

    def cpu(self) -> str:
        """The CPU's name and class from :meth:`device` (``cpu (AMD EPYC, AVX512-BF16``),
        without the thread count: what a budget's unit depends on."""
        return ", ".join(self.device().split(", ")[:2])

    @property
    def settings(self) -> list[str]:
        """This run's overrides, in the order typed, with ``seed``, Hydra's own and
        ``ckpt_path`` (a resumed run is the same run) left out."""
        skip = ("seed=", "hydra.", "hydra/", "ckpt_path=")
        return [o for o in self.overrides if not o.startswith(skip)]

    def command(self) -> str:
        """``python train.py`` with :attr:`settings`, each quoted where a shell would read
        it (``[0.95,1.05]`` is a glob pattern)."""
        return " ".join(["python train.py", *map(shlex.quote, self.settings)])


@dataclass
class Row:
    """Runs that differ only in their seed."""

    runs: list[Run] = field(default_factory=list)

    def _values(self, key: str) -> list[float]:
        return [float(r.metrics[key]) for r in self.runs if r.metrics.get(key) is not None]

    @property
    def first(self) -> dict[str, Any]:
        return self.runs[0].metrics

    @property
    def heads(self) -> int:
        """The number of heads per block of the row's model."""
        return int(self.first["model"]["num_heads"])

    def fit_times(self) -> list[float]:
        """Seconds from the first training step to the end of the last (``fit_time_s``; the
        whole ``trainer.fit`` for runs from before that was recorded); none when a run of
        the row was resumed from a checkpoint that did not carry its earlier fitting time
        (``fit_time_resumed_s`` missing or None: its figures cover the last stretch only)."""
        if any(
            r.metrics.get("resumed_from") and r.metrics.get("fit_time_resumed_s") is None
            for r in self.runs
        ):
            return []
        return self._values("fit_time_s") or self._values("train_time_s")

    @property
    def test_acc(self) -> tuple[float, float]:
        """Mean and sample standard deviation (0 for one seed) of test accuracy, in %."""
        values = [100 * v for v in self._values("test/acc")]
        if not values:
            return float("nan"), float("nan")
        return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0

    def command(self) -> str:
        """The command that reruns every seed of this row (a multirun when several)."""
        seeds = sorted(r.seed for r in self.runs)
        head, _, rest = self.runs[0].command().partition(" train.py")
        multirun = " -m" if len(seeds) > 1 else ""
        return f"{head} train.py{multirun}{rest} seed={','.join(map(str, seeds))}"

    def teacher(self) -> str:
        """The distillation teacher's test accuracy (%) and fitting time (s), read from the
        run dir its checkpoint (``module.teacher_ckpt=`` on the command line) was written
        in; ``-`` for a run without one."""
        given = (o for o in self.runs[0].overrides if o.startswith("module.teacher_ckpt="))
        ckpt = next(given, "=").partition("=")[2]
        if not ckpt:
            return "-"
        try:
            m = json.loads((Path(ckpt).parent.parent / "metrics.json").read_text())
            return f"{100 * m['test/acc']:.2f}%, {_seconds(m['fit_time_s'])} s"
        except (OSError, ValueError, KeyError, TypeError):
            return "no metrics.json beside its checkpoint"

    def budget(self, default: Run | None) -> str:
        """Each seed's fitting time over ``default``'s (a default ``python train.py`` run,
        the unit of the CPU recipes' budgets), as ``mean (min-max)x of <default> s``; ``-``
        without one, or when ``default`` ran on another CPU (name and class)."""
        fit = self.fit_times()
        if default is None or not fit or default.cpu() != self.runs[0].cpu():
            return "-"
        base = float(default.metrics["fit_time_s"])
        ratios = [f / base for f in fit]
        spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
        return f"{statistics.fmean(ratios):.2f}x{spread} of {_seconds(base)} s"

    def markdown(self, default: Run | None = None) -> list[str]:
        m = self.first
        mean, std = self.test_acc
        val = self._values("val/acc_best")
        fit = self.fit_times()
        # Start-up, data, compile and test included; measured from outside the process, so
        # only runs started by scripts/speedrun.py have it.
        command = self._values("command_wall_s")
        test = f"{mean:.2f} +- {std:.2f} (n={len(self.runs)})"
        one_view = [100 * v for v in self._values("test/acc_one_view")]
        if one_view:  # module.test_time_shift: the accuracy above averages shifted copies
            test += f", shifted copies averaged (one view: {statistics.fmean(one_view):.2f})"
        return [
            DATASET_NAMES.get(m.get("dataset"), str(m.get("dataset"))),
            str(m.get("experiment") or "-"),
            f"{m['num_params'] / 1e6:.2f}M",
            str(m.get("epochs")),
            f"{self.runs[0].device()}, {m.get('precision')}",
            _seconds(statistics.fmean(fit)) if fit else "-",
            self.budget(default),
            _seconds(statistics.fmean(command)) if command else "-",
            test,
            f"{100 * statistics.fmean(val):.2f}" if val else "-",
            self.teacher(),
            f"`{self.command()}`",
        ]


def _seconds(s: float) -> str:
    return f"{s:.0f}" if s >= 10 else f"{s:.1f}"


def find_runs(paths: Iterable[str | Path], tested: bool = True) -> list[Run]:
    """Every run dir (one holding ``metrics.json``) at or under ``paths``, sorted by path;
    with ``tested=False`` also those trained with ``test=false`` (a study's trials).

    Raises:
        FileNotFoundError: a path does not exist, or no run dir is found.
        ValueError: a run dir's ``metrics.json`` or ``overrides.yaml`` cannot be read (a
            half-written or damaged file): a table without that seed would mislead.
    """
    roots = [Path(p) for p in paths]
    runs = []
    for index, root in enumerate(roots):
        if not root.exists():
            raise FileNotFoundError(f"{root} does not exist")
        for metrics_file in sorted(root.rglob("metrics.json")):
            overrides_file = metrics_file.parent / ".hydra" / "overrides.yaml"
            if not overrides_file.is_file():
                continue  # an eval or export dir, not a training run
            try:
                metrics = json.loads(metrics_file.read_text())
                overrides = yaml.safe_load(overrides_file.read_text()) or []
            except (ValueError, yaml.YAMLError) as e:
                raise ValueError(
                    f"{metrics_file.parent} cannot be read ({type(e).__name__}); "
                    "move that run dir out of the way or train it again"
                ) from None
            if "seed" not in metrics or "epochs" not in metrics:
                continue  # an evaluation (eval.py) inside a run dir, not a training run
            if tested and "test/acc" not in metrics:
                continue
            runs.append(Run(metrics_file.parent, metrics, [str(o) for o in overrides], index))
    if not runs:
        where = ", ".join(map(str, roots))
        raise FileNotFoundError(f"no training run (metrics.json + .hydra/) under {where}")
    return runs


def find_failed(paths: Iterable[str | Path]) -> list[tuple[Path, str]]:
    """The jobs at or under ``paths`` that stopped on an error (``failed.json`` in their run
    dir, written by a multirun job that failed), as (run dir, error message), by path."""
    failed = []
    for root in map(Path, paths):
        for record in sorted(root.rglob(FAILED_FILE)) if root.exists() else []:
            try:
                message = json.loads(record.read_text()).get("error", "")
            except (OSError, ValueError):
                message = "failed.json cannot be read"
            failed.append((record.parent, message))
    return failed


def group_rows(runs: Iterable[Run]) -> list[Row]:
    """Group runs whose command lines hold the same overrides, in any order, once ``seed``
    is left out, and that ran on the same device (the same command on two CPU classes makes
    two rows).

    Rows come in the order of the paths given to :func:`find_runs`, then by dataset,
    experiment, ``embed_dim`` and ``num_heads``.
    """
    rows: dict[str, Row] = {}
    for run in runs:
        rows.setdefault(f"{sorted(run.settings)} on {run.device()}", Row()).runs.append(run)

    def order(row: Row) -> tuple:
        m = row.first
        model = m.get("model") or {}
        dataset = str(m.get("dataset"))
        return (
            row.runs[0].source_index,
            list(DATASET_NAMES).index(dataset) if dataset in DATASET_NAMES else len(DATASET_NAMES),
            dataset,
            str(m.get("experiment")),
            model.get("embed_dim", 0),
            model.get("num_heads", 0),
            row.runs[0].command(),
        )

    return sorted(rows.values(), key=order)


# Each table's header is written as its Markdown line, cut at the " | " between cells.
HEADER = (
    "dataset | experiment | parameters | epochs | hardware, precision | fitting time (s, mean)"
    " | fitting time / the default run's on that CPU | whole command (s, mean)"
    " | test acc % (mean +- std over seeds) | best val acc % (mean)"
    " | teacher: test acc, fitting time | command"
).split(" | ")


def _markdown(header: Sequence[str], lines: Iterable[Sequence[str]]) -> str:
    """A Markdown table of ``header`` and one line per list of cells."""
    return "".join(f"| {' | '.join(c)} |\n" for c in [header, ["---"] * len(header), *lines])


def markdown_table(rows: Sequence[Row], default: Run | None = None) -> str:
    """A Markdown table, one line per row, in the order given; ``default``: the default
    run whose fitting time is the budgets' unit on its CPU (:meth:`Row.budget`)."""
    return _markdown(HEADER, (row.markdown(default) for row in rows))


def heads_plot(rows: Sequence[Row], out: Path, title: str) -> Path:
    """Test accuracy (mean +- std over seeds) against heads, written to ``out`` (PNG)."""
    # A Figure of its own, not pyplot's: no GUI backend is chosen or needed.
    from matplotlib.figure import Figure

    from vit_mnist.io import save_figure

    heads, means, stds = zip(*sorted((row.heads, *row.test_acc) for row in rows), strict=True)
    fig = Figure(figsize=(5, 3.5), dpi=120)
    ax = fig.subplots()
    ax.errorbar(heads, means, yerr=stds, marker="o", capsize=4)
    ax.set_xscale("log", base=2)
    ax.set_xticks(heads, [str(h) for h in heads])
    embed_dim = rows[0].first["model"]["embed_dim"]
    ax.set_xlabel(f"num_heads (embed_dim {embed_dim}: head_dim = {embed_dim} / num_heads)")
    ax.set_ylabel("test accuracy, % (mean ± std over seeds)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out)
    return out


HEADS_FILE = "heads/head_importance.csv"  # eval.py analysis=heads, run in <run dir>/heads
ROLES_FILE = "roles/roles.csv"  # eval.py analysis=roles, run in <run dir>/roles
CIRCUITS_FILE = "circuits/circuits_heads.csv"  # eval.py analysis=circuits, in <run dir>/circuits
CIRCUITS_PATCHING_FILE = "circuits/circuits_patching.csv"
TEXT_COLUMNS = ("most_hurt_class", "component", "top_class")  # the rest are numbers


def _percentiles(values: Sequence[float]) -> str:
    """``median (10th-90th percentile)`` of ``values``."""
    q = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else None
    median = statistics.median(values)
    return f"{median:.2f} ({q[0]:.2f}-{q[-1]:.2f})" if q else f"{median:.2f}"


def _head_rows(run: Run, name: str) -> list[dict[str, Any]]:
    """The rows of the per-head CSV ``name`` in ``run``'s dir, numbers as floats and
    :data:`TEXT_COLUMNS` as text (empty cells left out); empty when the file is not there."""
    path = run.path / name
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return [
            {k: v if k in TEXT_COLUMNS else float(v) for k, v in r.items() if v not in ("", None)}
            for r in csv.DictReader(f)
        ]


def heads_of(run: Run) -> list[dict[str, Any]]:
    """The per-head rows of ``eval.py analysis=heads`` for this run (``<run>/heads/``), or
    where only ``analysis=roles`` ran (``<run>/roles/``) its rows, which hold the same
    ``acc_drop``, ``entropy_nats`` and ``mean_distance_px``; empty when neither analysis
    has been run."""
    return _head_rows(run, HEADS_FILE) or _head_rows(run, ROLES_FILE)


def heads_sweep_table(rows: Sequence[Row]) -> str:
    """One line per head count: accuracy, its gap to training, fitting time, and the per-head
    attention entropy, distance and importance over every head of every seed."""
    header = (
        "heads | head_dim | seeds | test acc % (mean +- std) | best val acc % (mean)"
        " | train - val acc at the end (pp, mean) | fitting time (s, mean)"
        " | entropy, nats: median (10th-90th pct.)"
        " | mean attention distance, px: median (10th-90th pct.)"
        " | acc drop when zeroed, pp: median (max)"
    ).split(" | ")
    lines = []
    for row in sorted(rows, key=lambda r: r.heads):
        mean, std = row.test_acc
        gaps = [
            100 * (float(r.metrics["train/acc"]) - float(r.metrics["val/acc"]))
            for r in row.runs
            if r.metrics.get("train/acc") is not None and r.metrics.get("val/acc") is not None
        ]
        per_head = [h for r in row.runs for h in heads_of(r)]
        drops = [100 * h["acc_drop"] for h in per_head]
        cells = [
            str(row.heads),
            str(row.first["model"]["embed_dim"] // row.heads),
            str(len(row.runs)),
            f"{mean:.2f} +- {std:.2f}",
            f"{100 * statistics.fmean(row._values('val/acc_best')):.2f}",
            f"{statistics.fmean(gaps):+.2f}" if gaps else "-",
            _seconds(statistics.fmean(row.fit_times())),
            _percentiles([h["entropy_nats"] for h in per_head]) if per_head else "-",
            _percentiles([h["mean_distance_px"] for h in per_head]) if per_head else "-",
            f"{statistics.median(drops):.2f} ({max(drops):.2f})" if drops else "-",
        ]
        lines.append(cells)
    return _markdown(header, lines)


def runs_table(rows: Sequence[Row]) -> str:
    """One line per run, by patch size, head count and seed: where it ran (``metrics.json``'s
    device line, with the CPU and its class), its precision and speed path, its fitting
    time (s), its test accuracy (%) and its run directory's name."""
    header = ["patch", "heads", "seed", "device", "precision, path", "fitting time (s)"]
    header += ["test acc %", "run"]

    def order(run: Run) -> tuple[int, int, int]:
        model = run.metrics["model"]
        return int(model.get("patch_size", 0)), int(model["num_heads"]), run.seed

    lines = []
    for run in sorted((run for row in rows for run in row.runs), key=order):
        m = run.metrics
        fit = m.get("fit_time_s") or m.get("train_time_s")
        cells = [
            str(m["model"].get("patch_size", "-")),
            str(m["model"]["num_heads"]),
            str(run.seed),
            run.device(),
            f"{m.get('precision')}, {m.get('speed_path', '-')}",
            _seconds(float(fit)) if fit else "-",
            f"{100 * float(m['test/acc']):.2f}",
            f"`{run.path.name}`",
        ]
        lines.append(cells)
    return _markdown(header, lines)


def _lift(head: dict[str, Any], part: str) -> float:
    """A head's attention share on ``part`` (ink, end, curve) over that part's area share:
    1 is no preference (0 where the part has no area)."""
    area = head[f"{part}_area"]
    return head[f"{part}_share"] / area if area > 0 else 0.0


def patch_tokens(row: Row) -> int:
    """The number of patch tokens of the row's model (the CLS token not counted)."""
    model = row.first["model"]
    return (int(model.get("img_size", 28)) // int(model["patch_size"])) ** 2


def _by_shape(row: Row) -> tuple[int, int]:
    return patch_tokens(row), row.heads


def roles_table(rows: Sequence[Row]) -> str:
    """One line per token count, head count and layer: the spread of the role figures over
    that layer's heads (:mod:`vit_mnist.analysis.roles`), as ``low-high``: the mean over
    seeds of the lowest and of the highest head's figure (heads are not matched across
    seeds). The ink lift is the attention share on ink over its area share (1: no
    preference); stroke ends and curves are their lift over the ink lift (above 1: the
    head prefers that part to the rest of the ink); centre is the attended distance to the
    ink's centre of mass over a uniform map's (below 1: central). Rows whose runs lack
    ``roles.csv`` are left out."""
    header = (
        "tokens | heads | layer | ink lift | stroke ends / ink (lift ratio)"
        " | curves / ink (lift ratio) | centre ratio | mean attention distance (px)"
        " | acc drop when zeroed (pp)"
    ).split(" | ")
    per_head = (  # one head's figure for each column from "ink lift" on
        lambda h: _lift(h, "ink"),
        lambda h: _lift(h, "end") / max(_lift(h, "ink"), 1e-9),
        lambda h: _lift(h, "curve") / max(_lift(h, "ink"), 1e-9),
        lambda h: h["centre_distance_px"] / h["centre_distance_uniform_px"],
        lambda h: h["mean_distance_px"],
        lambda h: 100 * h["acc_drop"],
    )

    def spread(per_run: list[list[float]]) -> str:
        low = statistics.fmean(min(v) for v in per_run)
        high = statistics.fmean(max(v) for v in per_run)
        return f"{low:.2f}" if len(per_run[0]) == 1 else f"{low:.2f}-{high:.2f}"

    lines = []
    for row in sorted(rows, key=_by_shape):
        per_run = [heads for r in row.runs if (heads := _head_rows(r, ROLES_FILE))]
        if not per_run:
            continue
        for layer in range(int(row.first["model"]["depth"])):
            layers = [[h for h in heads if h["layer"] == layer] for heads in per_run]
            cells = [str(patch_tokens(row)), str(row.heads), str(layer)]
            lines.append(cells + [spread([[f(h) for h in hs] for hs in layers]) for f in per_head])
    return _markdown(header, lines)


def _spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (torchmetrics'); NaN for fewer than 3 points."""
    import torch
    from torchmetrics.functional.regression import spearman_corrcoef

    if len(x) < 3:
        return float("nan")
    return float(spearman_corrcoef(torch.tensor(x).double(), torch.tensor(y).double()))


def _where(head: dict[str, Any]) -> tuple[int, int]:
    return int(head["layer"]), int(head["head"])


def circuit_figures(run: Run) -> dict[str, float] | None:
    """What the heads of one run write (``eval.py analysis=circuits`` in ``<run>/circuits/``,
    :mod:`vit_mnist.analysis.logit_attribution` and :mod:`~vit_mnist.analysis.patching`),
    in a few numbers; None when the analysis has not been run.

    - ``heads_share``: the heads' summed direct contribution to the margin (true minus
      runner-up) over all components' (embedding, heads, MLPs, biases): how much of the
      decision the heads write directly.
    - ``top_head_share``: the largest single head's share of the heads' positive
      contributions.
    - ``specificity``: per head, the largest share of its positive per-class contributions
      that goes to one class (0.1 = spread over 10 classes alike, 1 = one class only).
    - ``class_top_share``: per class, the share of the heads' positive contributions to
      that class written by its top head.
    - ``patch_best`` / ``noise_best``: per patched pair, the largest share of the logit
      difference that one head restores (denoising) / destroys (noising).
    - ``rho_entropy``, ``rho_distance``, ``rho_drop``: Spearman's rank correlation over the
      heads between their contribution to the margin and their attention entropy, their
      mean attention distance, and (where ``analysis=roles`` ran) the accuracy lost when
      they are zeroed.
    - ``end_specificity`` / ``other_specificity``: the mean specificity of the stroke-end
      heads (``analysis=roles``: an end lift at least twice the ink lift) and of the rest.
    """
    components = _head_rows(run, CIRCUITS_FILE)
    if not components:
        return None
    heads = [c for c in components if "head" in c]
    classes = [k[len("to_margin_") :] for k in components[0] if k.startswith("to_margin_")]
    # positive[head][class]: the head's positive contribution to that class's margin.
    positive = [[max(0.0, h.get(f"to_margin_{k}", 0.0)) for k in classes] for h in heads]

    def top_share(values: Sequence[float]) -> float:
        return max(values) / sum(values) if sum(values) > 0 else float("nan")

    specificity = [top_share(per_class) for per_class in positive]
    class_top = [top_share(per_head) for per_head in zip(*positive, strict=True)]
    margin = [h["to_margin"] for h in heads]
    head_margin = [max(0.0, m) for m in margin]
    figures = {
        "heads_share": sum(margin) / sum(c["to_margin"] for c in components),
        "top_head_share": max(head_margin) / sum(head_margin) if sum(head_margin) else 0.0,
        "specificity": statistics.median(specificity),
        "specificity_max": max(specificity),
        "class_top_share": statistics.median(class_top),
        "class_top_share_max": max(class_top),
        "rho_entropy": _spearman(margin, [h["entropy_nats"] for h in heads]),
        "rho_distance": _spearman(margin, [h["mean_distance_px"] for h in heads]),
    }
    path = run.path / CIRCUITS_PATCHING_FILE
    if path.is_file():
        best: dict[tuple[str, str, str], float] = {}  # by direction and patched pair
        with path.open(newline="") as f:
            for r in csv.DictReader(f):
                if r["kind"] == "heads":
                    pair = (r["direction"], r["clean"], r["corrupted"])
                    best[pair] = max(best.get(pair, float("-inf")), float(r["score"]))
        for direction, key in (("denoising", "patch_best"), ("noising", "noise_best")):
            if values := [v for (d, *_), v in best.items() if d == direction]:
                figures[key] = statistics.median(values)
                figures[f"{key}_max"] = max(values)
    roles = {_where(r): r for r in _head_rows(run, ROLES_FILE)}
    if roles:
        # (margin, roles row, specificity) of each head that analysis=roles has too
        matched = [
            (m, roles[_where(h)], s)
            for h, m, s in zip(heads, margin, specificity, strict=True)
            if _where(h) in roles
        ]
        figures["rho_drop"] = _spearman(
            [m for m, _, _ in matched], [r["acc_drop"] for _, r, _ in matched]
        )
        lifts = [(s, _lift(r, "end"), 2 * max(_lift(r, "ink"), 1e-9)) for _, r, s in matched]
        ends = [s for s, end, twice_ink in lifts if end >= twice_ink]
        others = [s for s, end, twice_ink in lifts if end < twice_ink]
        figures["end_heads"] = len(ends)
        if ends:
            figures["end_specificity"] = statistics.fmean(ends)
        if others:
            figures["other_specificity"] = statistics.fmean(others)
    return figures


def circuits_table(rows: Sequence[Row]) -> str:
    """One line per token count and head count: :func:`circuit_figures`, the mean over the
    row's runs that have ``analysis=circuits`` (rows without any are left out)."""
    header = (
        "tokens | heads | runs | test acc % | heads' share of the direct margin | top head's share"
        " | class specificity of a head: median (max) | top head's share of a class: median (max)"
        " | best head, patching: restored / destroyed, median (max) over pairs"
        " | rank corr. of contribution with entropy / distance / acc drop"
        " | stroke-end heads: n, specificity (others)"
    ).split(" | ")

    def mean(found: list[dict[str, float]], key: str, spec: str = ".2f") -> str:
        values = [f[key] for f in found if key in f and f[key] == f[key]]  # not NaN
        return format(statistics.fmean(values), spec) if values else "-"

    lines = []
    for row in sorted(rows, key=_by_shape):
        found = [f for f in map(circuit_figures, row.runs) if f]
        if not found:
            continue
        acc = statistics.fmean(100 * float(r.metrics["test/acc"]) for r in row.runs)
        ends = sum(f.get("end_heads", 0) for f in found)
        end_specificity = f"{mean(found, 'end_specificity')} ({mean(found, 'other_specificity')})"
        cells = [
            str(patch_tokens(row)),
            str(row.heads),
            str(len(found)),
            f"{acc:.2f}",
            mean(found, "heads_share"),
            mean(found, "top_head_share"),
            f"{mean(found, 'specificity')} ({mean(found, 'specificity_max')})",
            f"{mean(found, 'class_top_share')} ({mean(found, 'class_top_share_max')})",
            f"{mean(found, 'patch_best')} / {mean(found, 'noise_best')} "
            f"({mean(found, 'patch_best_max')} / {mean(found, 'noise_best_max')})",
            f"{mean(found, 'rho_entropy', '+.2f')} / {mean(found, 'rho_distance', '+.2f')} / "
            f"{mean(found, 'rho_drop', '+.2f')}",
            f"{ends}, {end_specificity}" if ends else "0",
        ]
        lines.append(cells)
    return _markdown(header, lines)


def val_curve(run: Run) -> list[float]:
    """The run's ``val/acc`` after each epoch (fractions), from its TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    if "val/acc" not in events.Tags()["scalars"]:
        return []
    return [e.value for e in sorted(events.Scalars("val/acc"), key=lambda e: e.step)]


def proxy_table(
    runs: Sequence[Run],
    proxies: Sequence[Run] = (),
    fractions: Sequence[float] = (0.25, 0.5),
) -> str:
    """Whether short runs would have ranked a study's configurations as their full runs do.

    Per configuration (a run dir of ``runs``): the best validation accuracy of its short
    proxy (the run dir of the same name among ``proxies``: its own schedule over fewer
    epochs, as an Optuna study's trials run), the validation accuracy after the first
    ``fraction`` of the full run's epochs (what a pruner sees of a full-length trial:
    Optuna's median pruner or Hyperband through the Lightning callback) and the full run's
    best; then Spearman's rank correlation of each proxy with the full runs' best. Values
    are percentages; the test accuracy is shown (``-`` for a run with ``test=false``),
    never ranked on."""
    short = {run.path.name: max(val_curve(run), default=float("nan")) for run in proxies}
    studied = [(run, curve) for run in runs if (curve := val_curve(run))]
    header = ["configuration"]
    header += [f"{len(val_curve(proxies[0]))}-epoch proxy: best val acc %"] if proxies else []
    header += [f"val acc % after {f:.0%} of the full run" for f in fractions]
    header += ["full run: epochs", "best val acc %", "test acc %"]
    lines, columns = [], {f: [] for f in ["short", *fractions]}
    for run, curve in studied:
        cells = [f"`{run.path.name}`"]
        if proxies:
            columns["short"].append(short.get(run.path.name, float("nan")))
            cells.append(f"{100 * columns['short'][-1]:.2f}")
        for f in fractions:
            columns[f].append(curve[max(0, round(f * len(curve)) - 1)])
            cells.append(f"{100 * columns[f][-1]:.2f}")
        test = f"{100 * run.metrics['test/acc']:.2f}" if "test/acc" in run.metrics else "-"
        lines.append([*cells, str(len(curve)), f"{100 * max(curve):.2f}", test])
    best = [max(curve) for _, curve in studied]
    rho = [f"{_spearman(columns[k], best):+.2f}" for k in columns if columns[k]]
    return _markdown(header, [*lines, ["Spearman with the full run", *rho, "", "", ""]])


def heads_sweep_figure(rows: Sequence[Row], out: Path) -> Path:
    """Per-head entropy, mean attention distance and accuracy drop against the number of
    heads: one dot per head of every seed and layer, the median as a line (PNG)."""
    from matplotlib.figure import Figure

    from vit_mnist.io import save_figure

    panels = [
        ("entropy_nats", 1.0, "attention entropy (nats)"),
        ("mean_distance_px", 1.0, "mean attention distance (px)"),
        ("acc_drop", 100.0, "test acc drop when zeroed (pp)"),
    ]
    fig = Figure(figsize=(11, 3.4), dpi=120)
    axes = fig.subplots(1, 3)
    ordered = sorted(rows, key=lambda r: r.heads)
    for ax, (key, scale, label) in zip(axes, panels, strict=True):
        medians = []
        for i, row in enumerate(ordered):
            values = [scale * h[key] for r in row.runs for h in heads_of(r)]
            if values:
                jitter = [i + 0.25 * ((k * 0.618) % 1 - 0.5) for k in range(len(values))]
                ax.scatter(jitter, values, s=6, alpha=0.35, color="tab:blue")
            medians.append(statistics.median(values) if values else float("nan"))
        ax.plot(range(len(ordered)), medians, color="tab:red", marker="o", label="median")
        ax.set_xticks(range(len(ordered)), [str(r.heads) for r in ordered])
        ax.set_xlabel("num_heads")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("every head of every layer and seed (dots) and the median (line)", fontsize=9)
    fig.tight_layout()
    save_figure(fig, out)
    return out
