"""The ecosystem's tools around a run: an Optuna study through Hydra's sweeper, and the
CSV and MLflow loggers beside TensorBoard, all offline."""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import ONE_EPOCH, TINY_MODEL
from tests.helpers import in_process
from vit_mnist.errors import ConfigError
from vit_mnist.tasks.train import train


def test_a_three_trial_optuna_study_optimises_validation_accuracy(tmp_path, monkeypatch, capsys):
    """`python train.py -m hparams_search=mnist_optuna` as typed (run in this process), on
    tiny settings: each trial a run of its own, the study's best value the best trial's
    val/acc_best, and no trial looks at the test set."""
    monkeypatch.chdir(tmp_path)
    code, _, stderr = in_process(
        monkeypatch,
        capsys,
        "-m",
        "hparams_search=mnist_optuna",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.pruner=null",  # its warm-up (4 epochs) is longer than these trials
        *ONE_EPOCH,
        *TINY_MODEL,
    )
    assert code == 0, stderr[-3000:]
    (sweep,) = (tmp_path / "outputs" / "train" / "multiruns").iterdir()
    trials = [json.loads((sweep / str(j) / "metrics.json").read_text()) for j in range(3)]
    assert all("test/acc" not in m for m in trials)
    study = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert study["best_value"] == pytest.approx(max(m["val/acc_best"] for m in trials))
    # The trials drew different learning rates from the search space.
    lrs = [
        float(o.split("=")[1])
        for j in range(3)
        for o in yaml.safe_load((sweep / str(j) / ".hydra" / "overrides.yaml").read_text())
        if o.startswith("module.lr=")
    ]
    assert len(set(lrs)) == 3 and all(5e-4 <= lr <= 1e-2 for lr in lrs)


def test_a_study_records_a_failed_trial_goes_on_and_minimises_a_loss(tmp_path, monkeypatch, capsys):
    """Three trials, the second drawing 3 heads for a width of 32 (an impossible model):
    that trial is recorded as FAIL with its failed.json and the study goes on; the results
    file holds every trial, and with optimized_metric=val/loss the best is the lowest loss.
    (hydra-optuna-sweeper's own sweeper ended such a study in a traceback, with no results,
    and kept the highest loss.)"""
    monkeypatch.chdir(tmp_path)
    code, _, stderr = in_process(
        monkeypatch,
        capsys,
        "-m",
        "hparams_search=mnist_optuna",
        "optimized_metric=val/loss",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.pruner=null",
        "hydra.sweeper.sampler.seed=6",  # draws 2, 3, 2 heads
        "model.num_heads=choice(2,3)",
        *ONE_EPOCH,
        *[o for o in TINY_MODEL if not o.startswith("model.num_heads")],
    )
    assert code == 1, stderr[-3000:]  # as any sweep with a failed job (README)
    assert "Traceback" not in stderr and "1 job(s) of the sweep failed" in stderr
    (sweep,) = (tmp_path / "outputs" / "train" / "multiruns").iterdir()
    failed = json.loads((sweep / "1" / "failed.json").read_text())
    assert failed["type"] == "ConfigError" and "num_heads=3" in failed["error"]
    study = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert study["direction"] == "minimize" and study["metric"] == "val/loss"
    assert [t["state"] for t in study["trials"]] == ["COMPLETE", "FAIL", "COMPLETE"]
    losses = {j: json.loads((sweep / j / "metrics.json").read_text())["val/loss"] for j in "02"}
    assert losses["0"] != losses["2"]
    best = min(losses, key=losses.get)
    assert study["best_value"] == pytest.approx(losses[best])
    assert study["best_job"] == str(sweep / best)


def test_a_study_with_a_pruner_stops_its_trials_and_records_them_as_pruned(
    tmp_path, monkeypatch, capsys
):
    """hydra.sweeper.pruner: each trial's run reports val/acc_best after every epoch, and a
    pruner that stops every trial from its second epoch on (no accuracy reaches 1.1) ends
    each 3-epoch run after 2 epochs; the results file records the trials as PRUNED with
    the value each last reported, and none as the best."""
    monkeypatch.chdir(tmp_path)
    code, _, stderr = in_process(
        monkeypatch,
        capsys,
        "-m",
        "hparams_search=mnist_optuna",
        "hydra.sweeper.n_trials=2",
        "~hydra.sweeper.pruner",  # mnist_optuna's median pruner, replaced
        "+hydra.sweeper.pruner={_target_:optuna.pruners.ThresholdPruner,lower:1.1,n_warmup_steps:1}",
        *[o for o in ONE_EPOCH if not o.startswith("trainer.max_epochs")],
        "trainer.max_epochs=3",
        *TINY_MODEL,
    )
    assert code == 0, stderr[-3000:]
    (sweep,) = (tmp_path / "outputs" / "train" / "multiruns").iterdir()
    runs = [json.loads((sweep / str(j) / "metrics.json").read_text()) for j in range(2)]
    assert [m["epochs"] for m in runs] == [2, 2]
    study = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert [t["state"] for t in study["trials"]] == ["PRUNED", "PRUNED"]
    assert [t["value"] for t in study["trials"]] == pytest.approx([m["val/acc_best"] for m in runs])
    assert study["best_value"] is None and study["best_job"] is None


def test_a_pruner_needs_one_trial_at_a_time_in_this_process(tmp_path, monkeypatch, capsys):
    from vit_mnist.training.callbacks.trial_pruning import TrialPruning

    monkeypatch.chdir(tmp_path)
    code, _, stderr = in_process(
        monkeypatch,
        capsys,
        "-m",
        "hparams_search=mnist_optuna",
        "hydra.sweeper.n_jobs=2",  # mnist_optuna's median pruner stays
        *ONE_EPOCH,
        *TINY_MODEL,
    )
    assert code == 2 and stderr.strip().splitlines() == [
        "error: hydra.sweeper.pruner needs one trial at a time in this process, and got "
        "hydra.sweeper.n_jobs=2 with BasicLauncher; set hydra.sweeper.n_jobs=1 and keep "
        "hydra/launcher=basic, or hydra.sweeper.pruner=null"
    ]
    assert not list(tmp_path.rglob("*.json"))
    with pytest.raises(ConfigError, match="no study is running here"):
        TrialPruning("val/acc_best")  # a run of its own has no trial to report to


@pytest.mark.parametrize("name", ["null", "val/accuracy"])
def test_a_study_of_a_metric_it_cannot_optimise_is_one_line(tmp_path, monkeypatch, capsys, name):
    # Before: every trial failed, then Optuna's traceback.
    monkeypatch.chdir(tmp_path)
    tiny = ["hydra.sweeper.n_trials=1", *ONE_EPOCH, *TINY_MODEL]  # what would run
    code, _, stderr = in_process(
        monkeypatch, capsys, "-m", "hparams_search=mnist_optuna", f"optimized_metric={name}", *tiny
    )
    assert code == 2 and stderr.strip().splitlines() == [
        f"error: optimized_metric={name} is not a metric an Optuna study can optimise; use one of "
        "['val/acc_best', 'val/acc', 'val/loss'], e.g. optimized_metric=val/acc_best"
    ]
    assert not list(tmp_path.rglob("*.json"))


@pytest.mark.parametrize("name", ["test/acc", "val/accuracy"])
def test_a_search_metric_must_be_a_validation_metric(make_train_cfg, name):
    with pytest.raises(ConfigError, match=f"optimized_metric={name}.*val/acc_best"):
        train(make_train_cfg(f"optimized_metric={name}"))


def test_csv_and_mlflow_log_beside_tensorboard_and_nothing_leaves_the_machine(
    make_train_cfg, tmp_path
):
    import os

    import mlflow

    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true"  # set by vit_mnist on import
    cfg = make_train_cfg("logger=[tensorboard,csv,mlflow]", f"paths.log_dir={tmp_path}")
    metrics = train(cfg)
    run_dir = tmp_path / "train"
    assert any((run_dir / "tensorboard").iterdir())
    # CSV: every epoch's validation accuracy, the run's size and its best checkpoint.
    with open(run_dir / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("val/acc")]
    assert len(rows) == 2
    assert float(rows[-1]["val/acc"]) == pytest.approx(metrics["val/acc"], abs=1e-6)
    hparams = yaml.safe_load((run_dir / "csv" / "hparams.yaml").read_text())
    assert hparams["num_params"] == metrics["num_params"]
    assert hparams["best_ckpt"] == metrics["best_ckpt"]
    # MLflow: one run in the local SQLite store, with the same figures.
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (experiment,) = [e for e in client.search_experiments() if e.name == "train"]
    (mlflow_run,) = client.search_runs([experiment.experiment_id])
    assert mlflow_run.data.params["best_ckpt"] == metrics["best_ckpt"]
    assert int(mlflow_run.data.params["num_params"]) == metrics["num_params"]
    history = client.get_metric_history(mlflow_run.info.run_id, "val/acc")
    assert len(history) == 2 and math.isclose(history[-1].value, metrics["val/acc"], abs_tol=1e-6)


@pytest.mark.slow  # a worker process that imports torch and Lightning: 8-15 s on 2 cores
def test_a_joblib_sweep_with_a_failed_job_exits_as_the_basic_launcher_does(
    tmp_path, monkeypatch, capsys
):
    """The joblib launcher runs the job in a worker process (n_jobs=2: not in this one):
    the failed job's record is its failed.json there, which the sweep reads at its end
    (before, the sweep exited 0). The basic launcher's case: tests/test_cli.py."""
    monkeypatch.chdir(tmp_path)
    code, _, stderr = in_process(
        monkeypatch,
        capsys,
        "-m",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "model.num_heads=3",
        *ONE_EPOCH,
        *[o for o in TINY_MODEL if not o.startswith("model.num_heads")],
    )
    assert code == 1, stderr[-3000:]
    (sweep,) = (tmp_path / "outputs" / "train" / "multiruns").iterdir()
    failed = json.loads((sweep / "0" / "failed.json").read_text())
    assert failed["type"] == "ConfigError" and "num_heads=3" in failed["error"]
    assert f"1 job(s) of the sweep failed:\n  {sweep / '0'}: " in stderr


def test_a_study_stopped_by_ctrl_c_keeps_the_trials_it_finished(tmp_path):
    """The results file is written after every trial, so an interrupt in the second trial
    leaves the first one's result (the upstream sweeper wrote its file at the very end)."""
    import optuna
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from hydra_plugins.vit_mnist_study import RESULTS_FILE, StudySweeper

    class InterruptedSecondJob:
        def launch(self, batch, initial_job_idx):
            if initial_job_idx == 1:
                raise KeyboardInterrupt
            job_dir = {"hydra": {"runtime": {"output_dir": str(tmp_path / "0")}}}
            done = JobReturn(status=JobStatus.COMPLETED, hydra_cfg=OmegaConf.create(job_dir))
            done.return_value = 0.25
            return [done]

    sweeper = StudySweeper(
        sampler=optuna.samplers.RandomSampler(seed=0),
        n_trials=3,
        n_jobs=1,
        params=OmegaConf.create({"module.lr": "interval(0.001, 0.01)"}),
    )
    sweeper.config = OmegaConf.create(
        {
            "optimized_metric": "val/loss",
            "module": {"lr": 0.002},  # the key the space sweeps must exist
            "hydra": {"sweep": {"dir": str(tmp_path)}},
        }
    )
    sweeper.launcher = InterruptedSecondJob()
    with pytest.raises(KeyboardInterrupt):
        sweeper.sweep([])
    study = yaml.safe_load((tmp_path / RESULTS_FILE).read_text())
    assert study["best_value"] == 0.25 and [t["state"] for t in study["trials"]] == ["COMPLETE"]
    assert 0.001 <= study["best_params"]["module.lr"] <= 0.01


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder no file can be made in, for root too (which chmod does not stop)."""
    import os
    import tempfile

    if os.geteuid() != 0:
        folder = tmp_path / "read_only"
        folder.mkdir()
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    try:  # sysfs refuses root a new file (EACCES)
        tempfile.TemporaryFile(dir="/sys/kernel").close()
    except OSError:
        yield Path("/sys/kernel")
    else:
        pytest.skip("no folder that root cannot write here")


@pytest.mark.parametrize(
    ("logger", "setting", "key"),
    [
        ("mlflow", "paths.log_dir={}", "tracking_uri"),
        ("csv", "logger.csv.save_dir={}/csv", "save_dir"),
        ("tensorboard", "logger.tensorboard.save_dir={}/tb", "save_dir"),
    ],
)
def test_a_read_only_log_folder_is_one_line_in_seconds(
    read_only_folder, tmp_path, monkeypatch, capsys, logger, setting, key
):
    # MLflow retried a read-only store for 1 min 50 s, then gave a traceback.
    start = time.perf_counter()
    code, _, stderr = in_process(
        monkeypatch,
        capsys,
        f"logger={logger}",
        setting.format(read_only_folder),
        f"hydra.run.dir={tmp_path / 'run'}",
        *ONE_EPOCH,
        *TINY_MODEL,
    )
    assert time.perf_counter() - start < 10
    assert code == 2, stderr[-3000:]
    (line,) = stderr.strip().splitlines()
    assert line.startswith(f"error: logger.{logger}.{key}=") and str(read_only_folder) in line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_disk_that_fills_while_tensorboard_writes_is_one_line(tmp_path, monkeypatch, capsys):
    """TensorBoard writes in a thread of its own: a full disk printed that thread's traceback
    and then the main thread's, interleaved with the progress."""
    import errno

    from tensorboard.summary.writer.record_writer import RecordWriter

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(RecordWriter, "write", full)
    run_dir = tmp_path / "run"
    code, _, stderr = in_process(
        monkeypatch, capsys, f"hydra.run.dir={run_dir}", *ONE_EPOCH, *TINY_MODEL
    )
    assert code == 2 and "Traceback" not in stderr and "Exception in thread" not in stderr
    (line,) = [x for x in stderr.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: cannot write the run's files in {run_dir}: No space left")


@pytest.mark.parametrize(
    ("override", "line"),
    [
        # Before: a 35-line traceback from Optuna.
        (
            "module.lr=tag(log, interval(-1, 1e-2))",
            "the search space's module.lr=tag(log, interval(-1, 1e-2)): a log scale needs "
            "bounds > 0, and the low bound is -1; e.g. tag(log, interval(0.0001, 0.01))",
        ),
        (
            "module.lr=interval(1e-2,1e-3)",
            "the search space's module.lr=interval(1e-2,1e-3): interval(low, high) needs "
            "low < high; write interval(0.001, 0.01)",
        ),
        (
            "model.depth=range(5,1)",
            "the search space's model.depth=range(5,1): range(5, 1) holds no value; "
            "e.g. range(1, 5)",
        ),
        (
            "model.num_head=choice(2,4)",
            "the search space's model.num_head=choice(2,4): model.num_head is not a setting "
            "of model; did you mean model.num_heads? (model.num_heads=choice(2,4))",
        ),
        (
            "model.dropout=choice(0.1,1.5)",
            "the search space's model.dropout=choice(0.1,1.5) draws a value the setting "
            "refuses: model.dropout=1.5 must be in [0, 1); e.g. model.dropout=0.1",
        ),
        # Before: accepted, exit 0, and a line promising a results file never written.
        ("hydra.sweeper.n_trials=0", "hydra.sweeper.n_trials=0 must be >= 1; e.g. "),
        ("hydra.sweeper.n_trials=-3", "hydra.sweeper.n_trials=-3 must be >= 1; e.g. "),
        # Before: accepted, and the median pruner's 4-epoch warm-up outlasted the 1-epoch
        # trials: it never pruned.
        (
            "hydra.sweeper.n_trials=1",
            "hydra.sweeper.pruner.n_warmup_steps=4: the pruner may stop a trial from epoch 4 "
            "on, and each trial runs trainer.max_epochs=1 (epochs 0 to 0), so it would never "
            "prune; lower n_warmup_steps below 1, or turn the pruner off with "
            "hydra.sweeper.pruner=null",
        ),
        # Before: Hydra's "Sweeping over Hydra's configuration is not supported".
        (
            "hydra.sweeper.params.module.lr=interval(1e-3,1e-2)",
            "hydra.sweeper.params.module.lr=interval(1e-3,1e-2): a search-space entry is "
            "given on the command line by its key alone, 'module.lr=interval(1e-3,1e-2)', "
            "and joins hydra.sweeper.params",
        ),
        # Before: Hydra's own line, with its HYDRA_FULL_ERROR advice.
        (
            "hydra.sweeper.pruner._target_=optuna.pruners.Nope",
            "hydra.sweeper.pruner._target_=optuna.pruners.Nope cannot be imported "
            "(optuna.pruners has no 'Nope'); check its spelling",
        ),
        (
            "hydra.sweeper.pruner.n_warmup_steps=-2",
            "hydra.sweeper.pruner: optuna.pruners.MedianPruner refuses its arguments "
            "(Number of warmup steps cannot be negative but got -2.); fix them, e.g. ",
        ),
        (
            "~hydra.sweeper.sampler|+hydra.sweeper.sampler={_target_:optuna.pruners.MedianPruner}",
            "hydra.sweeper.sampler._target_=optuna.pruners.MedianPruner is not an Optuna "
            "sampler; use one of optuna.samplers's, e.g. ",
        ),
    ],
)
def test_a_search_is_checked_before_its_first_trial(tmp_path, monkeypatch, capsys, override, line):
    """Issue 102: the search space, n_trials, the pruner and the sampler go through the
    checks before any trial: one line in the user's words (the entry as written), exit 2,
    no run dir of a trial and no results file."""
    monkeypatch.chdir(tmp_path)
    tiny = ["hydra.sweeper.n_trials=1", *ONE_EPOCH, *TINY_MODEL]  # what would run
    code, _, stderr = in_process(
        monkeypatch, capsys, "-m", "hparams_search=mnist_optuna", *tiny, *override.split("|")
    )
    (said,) = stderr.strip().splitlines()
    assert code == 2 and said.startswith(f"error: {line}"), said
    assert not list(tmp_path.rglob("*.json")) and not list(tmp_path.rglob("*.yaml"))
