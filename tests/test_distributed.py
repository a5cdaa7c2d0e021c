"""Several processes: DDP on CPU processes, Hydra's joblib and submitit launchers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import ROOT, TINY_MODEL, compose_config, compose_with_hydra
from tests.helpers import in_process
from vit_mnist.tasks.evaluate import evaluate
from vit_mnist.training.checkpointing import read_checkpoint

TINY = ["data=synthetic", "trainer.max_epochs=2", "~callbacks.progress_bar", *TINY_MODEL]


def run_train(*overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("LOCAL_RANK", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_events(run_dir: Path) -> tuple[dict[str, list[float]], EventAccumulator]:
    """(scalar values by tag, the accumulator) of a run dir's TensorBoard events."""
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}, acc


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_inside_a_multirun(tmp_path):
    """A one-job `-m` sweep: Lightning starts DDP's second process by running the command
    line again, which here is the sweep; the job must run as itself, in its own run dir."""
    result = run_train(
        "-m",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        *TINY,
        # A fixed path: auto's timing (seconds in each process) has tests of its own.
        "speed.path=reference",
        "trainer.precision=32-true",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    # No second sweep and no stray run dir: the second process ran this job, here.
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == ["0", "multirun.yaml"]
    run_dir = tmp_path / "sweep" / "0"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    assert metrics["device"].startswith("cpu (") and "2 processes x " in metrics["device"]
    assert metrics["effective_batch_size"] == 2 * 64
    # 512 training images over 2 processes at 64 per batch: 4 steps an epoch.
    assert metrics["global_steps"] == 2 * 4 and metrics["epochs"] == 2

    # Rank 0 alone writes the events: one process id in the file names, and one
    # attention panel per validation epoch (not one per process).
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len({name.name.rsplit(".", 2)[1] for name in events}) == 1, events
    series, acc = read_events(run_dir)
    assert len(acc.Images("attention/layer_0")) == 2
    # val/acc_best is the best of the all-reduced val/acc.
    assert metrics["val/acc_best"] == pytest.approx(max(series["val/acc"]), abs=1e-7)

    best = Path(metrics["best_ckpt"])
    ckpt = read_checkpoint(best)
    assert ckpt["val_acc_best"] == pytest.approx(metrics["val/acc_best"], abs=1e-7)
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()

    # The all-reduced test metrics equal one process testing the whole test set.
    cfg = compose_config("eval", [f"ckpt_path={best}", "trainer=cpu"], tmp_path / "eval")
    single = evaluate(cfg)
    assert single["test/acc"] == pytest.approx(metrics["test/acc"], abs=1e-7)
    assert single["test/loss"] == pytest.approx(metrics["test/loss"], rel=1e-5)


def _pids_running(run_dir: Path) -> list[int]:
    """The processes whose command line names ``run_dir`` (both DDP processes)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(run_dir) in (proc / "cmdline").read_text():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the processes through /proc")
def test_sigterm_to_every_ddp_process_stops_them_at_one_batch_and_saves_once(tmp_path):
    """What SLURM's scancel or a signal to the process group does. Lightning's own SIGTERM
    handler broadcast inside the handler, and both processes waited on each other for ever
    with nothing saved; now they agree on the signal after a batch and save together."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), "trainer=ddp", "trainer.accelerator=cpu"]
        + ["trainer.devices=2", *TINY, "trainer.max_epochs=200", "data.num_train=2048"]
        + ["speed.path=reference", "trainer.precision=32-true", f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "LOCAL_RANK"},
    )
    last = run_dir / "checkpoints" / "last.ckpt"
    deadline = time.time() + 120
    while not (last.is_file() and len(_pids_running(run_dir)) == 2):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    before = read_checkpoint(last)["global_step"]
    for pid in _pids_running(run_dir):
        os.kill(pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-3000:]
    assert (stdout + stderr).count("Resume with:") == 1
    assert read_checkpoint(last)["global_step"] > before
    assert not _pids_running(run_dir)


# The launcher classes that hydra/launcher=<name> instantiates.
LAUNCHERS = {"joblib": ".JoblibLauncher", "submitit_local": ".LocalLauncher"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("launcher", "plugin", "heads"),
    [
        ("joblib", "hydra_joblib_launcher", [2, 4]),
        # The submitit path that SLURM jobs take (pickled job, own process), run locally;
        # one job, as the run dir per job is the sweep's (tested with joblib) and a second
        # job process costs its start-up, 5 s of imports.
        ("submitit_local", "hydra_submitit_launcher", [4]),
    ],
)
def test_launcher_writes_one_run_dir_per_job(
    tmp_path, launcher, plugin, heads, monkeypatch, capsys
):
    """The sweep is started in this process; the launcher runs each job in a process of
    its own (joblib's workers, submitit's job process)."""
    pytest.importorskip(f"hydra_plugins.{plugin}")
    sweep_dir = tmp_path / "sweep"
    code, _, stderr = in_process(
        monkeypatch,
        capsys,
        "-m",
        f"hydra/launcher={launcher}",
        "model.num_heads=" + ",".join(map(str, heads)),
        *[o for o in TINY if not o.startswith("model.num_heads")],
        "trainer=cpu",
        "trainer.max_epochs=1",
        # A fixed path: auto's timing (seconds per job) has tests of its own.
        "speed.path=handwritten",
        "trainer.precision=32-true",
        f"hydra.sweep.dir={sweep_dir}",
    )
    if launcher == "joblib":
        # joblib keeps its worker processes for a next sweep, and this process would wait
        # 2.7 s at exit for them to finish tearing down torch: they go now.
        from joblib.externals.loky import reusable_executor

        if reusable_executor._executor is not None:
            reusable_executor._executor.shutdown(wait=True, kill_workers=True)
    assert code == 0, stderr[-4000:]
    jobs = sorted(p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [p.name for p in jobs] == [str(j) for j in range(len(heads))]
    trained = []
    for job in jobs:
        metrics = json.loads((job / "metrics.json").read_text())
        trained.append(metrics["model"]["num_heads"])
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        assert f"model.num_heads={metrics['model']['num_heads']}" in overrides
        assert next((job / "checkpoints").glob("best-*.ckpt"))
        # Run by the launcher asked for.
        hydra_cfg = yaml.safe_load((job / ".hydra" / "hydra.yaml").read_text())["hydra"]
        assert hydra_cfg["launcher"]["_target_"].endswith(LAUNCHERS[launcher])
    assert sorted(trained) == heads


def test_slurm_launcher_preset_composes():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    cfg = compose_with_hydra("train", ["hydra/launcher=slurm", "hydra.launcher.partition=gpu"])
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.partition == "gpu" and launcher.tasks_per_node == 1
    assert launcher.gpus_per_node == 1


def test_ddp_in_a_local_multirun_starts_its_processes_as_this_job(monkeypatch, tmp_path):
    """Lightning starts DDP's second process by running sys.argv again in HydraConfig's
    run.dir: in a multirun that would be the whole sweep, in a folder not the job's. The
    job's own overrides in RUN mode and its run dir go there instead, and what the job
    before it left behind (Lightning's rank variables) is cleared, else Lightning would
    take this process for a child and start none."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from vit_mnist.tasks.train import prepare_ddp_launch

    cfg = compose_with_hydra("train", ["trainer=ddp", "seed=2"])
    cfg.hydra.mode = RunMode.MULTIRUN
    cfg.hydra.runtime.output_dir = str(tmp_path / "sweep" / "1")
    HydraConfig().set_config(cfg)
    monkeypatch.setattr(sys, "argv", ["train.py", "-m", "seed=1,2"])
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    prepare_ddp_launch(cfg.trainer)
    assert sys.argv == ["train.py", "trainer=ddp", "seed=2", "hydra.mode=RUN"]
    assert HydraConfig.get().run.dir == str(tmp_path / "sweep" / "1")
    assert "LOCAL_RANK" not in os.environ and "WORLD_SIZE" not in os.environ
