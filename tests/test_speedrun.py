"""experiment=speedrun and scripts/speedrun.py."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.conftest import ROOT, TINY_MODEL, compose_config


def load_script():
    spec = importlib.util.spec_from_file_location("speedrun", ROOT / "scripts" / "speedrun.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_speedrun_recipe_composes_as_documented(tmp_path):
    cfg = compose_config("train", ["experiment=speedrun"], tmp_path)
    assert cfg.task_name == "speedrun"
    assert cfg.data._target_ == "vit_mnist.data.MNISTDataModule"
    # Nothing fixed by one machine: path, precision and device as the default run's, in
    # the default's one process; 128 images per step.
    default = compose_config("train", [], tmp_path)
    assert cfg.trainer == {**default.trainer, "max_epochs": 10, "check_val_every_n_epoch": 10}
    assert cfg.speed == default.speed and cfg.speed.path == "auto"
    assert cfg.data.batch_size == 128 and cfg.module.test_time_shift == 1
    assert cfg.callbacks.get("attention_maps") is None
    # One validation, after the last epoch, wherever the user moves the last epoch.
    assert cfg.trainer.check_val_every_n_epoch == cfg.trainer.max_epochs == 10
    longer = compose_config("train", ["experiment=speedrun", "trainer.max_epochs=20"], tmp_path)
    assert longer.trainer.check_val_every_n_epoch == 20


@pytest.mark.slow
def test_speedrun_script_reports_every_seed(tmp_path, capsys, monkeypatch):
    speedrun = load_script()
    # Eager: inductor's first compile would add half a minute to the suite.
    overrides = [
        "data=synthetic",
        "trainer.max_epochs=1",
        *TINY_MODEL,
        "speed.path=reference",
        "trainer.precision=32-true",
        "module.lr=3e-3",
    ]
    # Seed 1 is a real `python train.py` process (the whole command is the script's clock);
    # seed 2 reuses its figures under its own seed, as the table and summary need only a
    # second row: a second process would add its start-up, seconds, and test nothing new.
    real_run_seed = speedrun.run_seed
    first: dict = {}

    def run_seed(seed, out, overrides):
        if not first:
            first.update(real_run_seed(seed, out, overrides))
            return dict(first)
        return {**first, "seed": seed}

    monkeypatch.setattr(speedrun, "run_seed", run_seed)
    # A target nothing reaches: exit status 1, after every seed has run and been printed.
    code = speedrun.main(["--seeds", "2", "--target", "1.01", "--out", str(tmp_path), *overrides])
    out = capsys.readouterr().out
    assert code == 1
    assert "| 1 |" in out and "| 2 |" in out and "| mean |" in out
    assert "0/2 seeds reached 101.0%" in out
    summary = json.loads((tmp_path / "speedrun.json").read_text())
    assert [r["seed"] for r in summary["runs"]] == [1, 2]
    for run in summary["runs"]:
        assert run["world_size"] == 1 and run["experiment"] == "speedrun"
        assert 0 < run["fit_time_s"] < run["command_wall_s"]
    # The whole command's clock is in the run's own metrics.json, for scripts/results.py;
    # the recipe's test averages shifted copies, so the one-view accuracy is printed too.
    written = json.loads((tmp_path / "seed_1" / "metrics.json").read_text())
    assert written["command_wall_s"] == summary["runs"][0]["command_wall_s"]
    assert f"| {100 * written['test/acc_one_view']:.2f}% |" in out


def test_speedrun_script_stops_on_a_failed_run(tmp_path, capsys):
    speedrun = load_script()
    # A key that does not exist stops train.py at once (Hydra's composition, before torch is
    # imported): the same exit status 2 as any bad setting, in a second rather than five.
    assert speedrun.main(["--seeds", "1", "--out", str(tmp_path), "model.no_such_key=1"]) == 2
    assert "seed 1 failed (exit 2)" in capsys.readouterr().err
