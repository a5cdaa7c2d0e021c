"""The ecosystem's tools around a run: an Optuna study through Hydra's sweeper, and the
CSV and MLflow loggers beside TensorBoard, all offline."""

from __future__ import annotations

import csv
import json
import math

import pytest
import yaml

from tests.conftest import ONE_EPOCH, TINY_MODEL
from tests.helpers import in_process
from vit_mnist.errors import ConfigError
from vit_mnist.train import train


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
