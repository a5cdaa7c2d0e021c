"""The stored speed choice (vit_mnist/speed/stored_choices.py): measured once per machine
and model, reused by every later run with the same key, guarded against a lucky timing,
never paid before a run that will not train."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vit_mnist.models.vit import VisionTransformer
from vit_mnist.speed import choose as choose_mod
from vit_mnist.speed import stored_choices
from vit_mnist.speed.choose import PATHS, choose, note_loop_speed

CPU = torch.device("cpu")
MODEL = dict(patch_size=14, embed_dim=16, depth=1, num_heads=2)


def _fake_timing(figures: dict[str, float], calls: list):
    """A stand-in for time_candidates: ``figures`` for the pairs asked, rounds that agree."""

    def time_candidates(net, pairs, **kwargs):
        calls.append([f"{p} {q}" for p, q in pairs])
        return choose_mod.Timing({f"{p} {q}": figures[f"{p} {q}"] for p, q in pairs}, rounds=5)

    return time_candidates


@pytest.fixture
def two_paths(monkeypatch):
    """Two eager candidates at float32 (``fused``, ``handwritten``), nothing else."""
    monkeypatch.setattr("vit_mnist.speed.native.isa_class", lambda: "ARM")
    monkeypatch.setattr("vit_mnist.speed.choose.has_native_bf16", lambda on_cuda: False)
    monkeypatch.setattr(
        choose_mod, "PATHS", {k: PATHS[k] for k in ("reference", "fused", "handwritten")}
    )


def _choose(model: dict | None = None, **kwargs):
    model = model or MODEL
    net = VisionTransformer(**model)
    return choose(net, device=CPU, batch_size=4, model_args=model, precision="32-true", **kwargs)


def test_a_second_run_with_the_same_key_times_nothing_and_says_reused(
    monkeypatch, two_paths, caplog
):
    calls: list = []
    figures = {"reference 32-true": 90.0, "fused 32-true": 100.0, "handwritten 32-true": 120.0}
    monkeypatch.setattr(choose_mod, "time_candidates", _fake_timing(figures, calls))
    first = _choose()
    assert (first.path, first.how, len(calls)) == ("handwritten", "measured", 1)
    assert "measured now in" in first.describe(CPU)

    monkeypatch.setattr(choose_mod, "time_candidates", lambda *a, **k: pytest.fail("timed"))
    again = _choose()
    assert (again.path, again.precision, again.how) == ("handwritten", "32-true", "reused")
    line = again.describe(CPU)
    assert "reused in" in line and "chosen on " in line and "speed.remeasure=true" in line
    assert again.seconds < 1.0
    # speed.remeasure=true times afresh.
    monkeypatch.setattr(choose_mod, "time_candidates", _fake_timing(figures, calls))
    assert _choose(remeasure=True).how == "measured" and len(calls) == 2


def test_prepare_speed_logs_a_reused_choice(monkeypatch, two_paths, caplog):
    from omegaconf import OmegaConf

    from vit_mnist.training.module import ViTClassifier

    calls: list = []
    figures = {"reference 32-true": 90.0, "fused 32-true": 100.0, "handwritten 32-true": 80.0}
    monkeypatch.setattr(choose_mod, "time_candidates", _fake_timing(figures, calls))
    cfg = OmegaConf.create(
        {
            "speed": {"path": "auto", "compile": False},
            "trainer": {"accelerator": "cpu", "precision": "32-true", "max_epochs": 400},
            "data": {"batch_size": 4},
        }
    )
    data = SimpleNamespace(train_size=64, augment=None)  # 16 steps an epoch, 6,400 in all
    with caplog.at_level(logging.INFO, logger="vit_mnist.speed.choose"):
        choose_mod.prepare_speed(ViTClassifier(model=MODEL), cfg, data)
        monkeypatch.setattr(choose_mod, "time_candidates", lambda *a, **k: pytest.fail("timed"))
        choose_mod.prepare_speed(ViTClassifier(model=MODEL), cfg, data)
    lines = [r.getMessage() for r in caplog.records if "speed path:" in r.getMessage()]
    assert "measured now in" in lines[0] and "reused in" in lines[1], lines
    assert all(line.startswith("speed path: fused, precision 32-true") for line in lines)


def test_another_num_heads_measures_again(monkeypatch, two_paths):
    calls: list = []
    figures = {"reference 32-true": 90.0, "fused 32-true": 100.0, "handwritten 32-true": 80.0}
    monkeypatch.setattr(choose_mod, "time_candidates", _fake_timing(figures, calls))
    assert _choose().how == "measured"
    assert _choose({**MODEL, "num_heads": 4}).how == "measured" and len(calls) == 2
    # Dropout changes no shape: the choice is reused.
    assert _choose({**MODEL, "dropout": 0.3}).how == "reused" and len(calls) == 2
    # The batch size and the precision setting are in the key too.
    net = VisionTransformer(**MODEL)
    assert choose(net, device=CPU, batch_size=8, model_args=MODEL, precision="32-true").how == (
        "measured"
    )


def test_a_run_too_short_to_pay_for_a_timing_takes_the_stored_choice_or_the_default(
    monkeypatch, two_paths
):
    calls: list = []
    figures = {"reference 32-true": 90.0, "fused 32-true": 100.0, "handwritten 32-true": 80.0}
    monkeypatch.setattr(choose_mod, "time_candidates", _fake_timing(figures, calls))
    short = _choose(steps_to_train=50)
    assert (short.path, short.how, calls) == ("handwritten", "default", [])
    assert "50 steps are too few" in short.describe(CPU)
    _choose(steps_to_train=None)  # stores fused
    assert _choose(steps_to_train=50).path == "fused"


def test_a_damaged_or_foreign_store_is_ignored_with_one_warning(monkeypatch, two_paths, caplog):
    calls: list = []
    figures = {"reference 32-true": 90.0, "fused 32-true": 100.0, "handwritten 32-true": 80.0}
    monkeypatch.setattr(choose_mod, "time_candidates", _fake_timing(figures, calls))
    file = stored_choices.store_path()
    file.parent.mkdir(parents=True)
    for damaged in (b'{"layout": 1, "choices": {"ab', b"\xff\xfe\x00", b'["a list"]'):
        file.write_bytes(damaged)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            choice = _choose()
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and str(file) in warnings[0], warnings
        assert choice.how == "measured"
        # The file was replaced by a readable one holding the new choice.
        assert len(json.loads(file.read_text())["choices"]) == 1
        file.write_bytes(damaged)


_WRITER = """
import sys
from vit_mnist.speed.stored_choices import StoredChoice, write_choice
for i in range(int(sys.argv[2])):
    entry = StoredChoice({"writer": sys.argv[1], "i": i})
    entry.add({"fused 32-true": 100.0 + i})
    write_choice(entry)
"""


def test_two_processes_writing_at_once_leave_a_readable_file_with_both(tmp_path):
    env = {"VIT_MNIST_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parents[1]
    writers = [
        subprocess.Popen([sys.executable, "-c", _WRITER, name, "25"], env=env, cwd=root)
        for name in ("a", "b")
    ]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    data = json.loads((tmp_path / stored_choices.FILE_NAME).read_text())
    assert len(data["choices"]) == 50  # none lost to the other's write
    assert not list(tmp_path.glob("*.tmp"))


def _clocked_paths(monkeypatch, step_s: dict[str, float]) -> None:
    """Paths ``fused`` and ``handwritten`` whose steps take ``step_s[name]`` seconds on a
    fake clock that only the steps move: the test sets each path's speed, run by run."""
    clock = [0.0]

    def timed(name):
        def build(net):
            def forward(x, heads=False):
                clock[0] += step_s[name]
                return net(x)

            return forward

        return dataclasses.replace(PATHS["reference"], build=build)

    monkeypatch.setattr(choose_mod, "PATHS", {n: timed(n) for n in ("fused", "handwritten")})
    monkeypatch.setattr(choose_mod, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr("vit_mnist.speed.native.isa_class", lambda: "ARM")
    monkeypatch.setattr("vit_mnist.speed.choose.has_native_bf16", lambda on_cuda: False)


def test_a_lucky_first_timing_is_not_kept_for_every_later_run(monkeypatch):
    """The first timing caught ``fused`` in a fast spell (1/128 s a step against
    ``handwritten``'s steady 1/64 s); the run then trained at a quarter of that figure. The
    loop's shortfall unsettles the choice, the next runs time the two leaders again, and
    once the figures agree the choice is reused without timing."""
    step_s = {"fused": 1 / 128, "handwritten": 1 / 64}
    _clocked_paths(monkeypatch, step_s)
    first = _choose()
    assert (first.path, first.how) == ("fused", "measured")
    assert first.images_per_s["fused 32-true"] == pytest.approx(4 * 128)

    step_s["fused"] = 1 / 32  # its real speed, which the run's loop shows
    note_loop_speed(first, 4 * 32)
    second = _choose()
    assert (second.path, second.how) == ("handwritten", "re-timed")
    third = _choose()  # fused's median is still above (its lucky figure): timed once more
    assert (third.path, third.how) == ("handwritten", "re-timed")

    monkeypatch.setattr(choose_mod, "time_candidates", lambda *a, **k: pytest.fail("timed"))
    settled = _choose()
    assert (settled.path, settled.how) == ("handwritten", "reused")


def test_rounds_that_disagree_are_said_and_timed_again_by_the_next_run(monkeypatch, two_paths):
    figures = {"reference 32-true": 90.0, "fused 32-true": 256.0, "handwritten 32-true": 128.0}
    noisy = choose_mod.Timing(figures, spread=0.6, rounds=5)  # a busy spell in the timing
    monkeypatch.setattr(choose_mod, "time_candidates", lambda *a, **k: noisy)
    first = _choose()
    assert "rounds disagreed by 60%: the next run times the leaders again" in first.describe(CPU)
    calls: list = []
    monkeypatch.setattr(choose_mod, "time_candidates", _fake_timing(figures, calls))
    assert _choose().how == "re-timed" and calls == [["fused 32-true", "handwritten 32-true"]]
    assert _choose().how == "reused"  # the rounds agreed: settled


def test_a_busy_machines_timings_settle_after_two_retimings(monkeypatch, two_paths):
    """Timings cut short every time (a machine too busy to time): the leaders are timed
    again twice, then the median of the three timings settles the choice."""
    figures = {"reference 32-true": 90.0, "fused 32-true": 100.0, "handwritten 32-true": 80.0}
    busy = choose_mod.Timing(figures, rounds=0, cut_short=True)
    monkeypatch.setattr(choose_mod, "time_candidates", lambda *a, **k: busy)
    hows = [_choose().how for _ in range(3)]
    assert hows == ["measured", "re-timed", "re-timed"]
    monkeypatch.setattr(choose_mod, "time_candidates", lambda *a, **k: pytest.fail("timed"))
    settled = _choose()
    assert settled.how == "reused"
    # The machine is idle again: a loop far above the busy figure unsettles the choice.
    note_loop_speed(settled, 80 * settled.images_per_s["fused 32-true"])
    monkeypatch.setattr(choose_mod, "time_candidates", lambda *a, **k: busy)
    assert _choose().how == "re-timed"


def test_resuming_a_finished_run_measures_nothing_and_stops_in_one_line(
    make_train_cfg, monkeypatch, tmp_path, capsys
):
    from vit_mnist.tasks import train as train_mod

    train_mod.train(make_train_cfg("trainer.max_epochs=1", output_dir=tmp_path / "first"))
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    monkeypatch.setattr(train_mod, "prepare_speed", lambda *a, **k: pytest.fail("timed"))
    resume = make_train_cfg(
        "trainer.max_epochs=1", "speed.path=auto", f"ckpt_path={last}", output_dir=tmp_path / "r"
    )
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        train_mod.main(resume)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has trained 1 epochs, all of trainer.max_epochs=1" in err[0], err
    assert "nothing is left to train" in err[0]
    assert not (tmp_path / "r" / "metrics.json").exists()


def test_a_compiled_run_keeps_inductors_caches_in_the_cache_folder(monkeypatch, tmp_path):
    """Inductor's default folder (in /tmp, emptied by a reboot) gives way to the cache
    folder; a folder the user named is kept."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("VIT_MNIST_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # set by importing torch
    choose_mod.keep_compiles()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    choose_mod.keep_compiles()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_remeasure_with_nothing_to_time_is_refused(make_train_cfg):
    """A value accepted but not applied: with the path and the precision forced, nothing
    is timed, so speed.remeasure=true is refused in one line; with auto it is taken."""
    from vit_mnist.errors import ConfigError
    from vit_mnist.training.checks import check_run

    forced = make_train_cfg(
        "speed.path=reference", "trainer.precision=32-true", "speed.remeasure=true"
    )
    with pytest.raises(ConfigError, match=r"speed.remeasure=true .* speed.path=reference with "):
        check_run(forced)
    check_run(make_train_cfg("speed.path=auto", "speed.remeasure=true"))


def test_a_cache_folder_that_cannot_be_written_costs_a_warning_not_the_run(
    monkeypatch, two_paths, tmp_path, caplog
):
    calls: list = []
    figures = {"reference 32-true": 90.0, "fused 32-true": 100.0, "handwritten 32-true": 80.0}
    monkeypatch.setattr(choose_mod, "time_candidates", _fake_timing(figures, calls))
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setattr(stored_choices, "store_path", lambda: blocker / "speed_choices.json")
    with caplog.at_level(logging.WARNING):
        choice = _choose()
    assert choice.path == "fused" and "stored for later runs" not in choice.describe(CPU)
    assert [r.getMessage() for r in caplog.records if "could not store" in r.getMessage()]
