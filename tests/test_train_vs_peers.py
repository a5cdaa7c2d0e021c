"""scripts/train_vs_peers.py builds the peers as the run's model, and reports pair by pair."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import ROOT

# Depends on the CPU's instruction set: CI runs it again under AVX2 emulation (.ci/run).
pytestmark = pytest.mark.isa

METRICS = {
    "model": {
        "img_size": 28,
        "in_chans": 1,
        "num_classes": 10,
        "patch_size": 7,
        "embed_dim": 64,
        "depth": 6,
        "num_heads": 4,
        "mlp_ratio": 2.0,
        "causal": False,
    },
    "effective_batch_size": 256,
    "precision": "bf16-mixed",
    "speed_path": "native",
    "train_images_per_s": 6000.0,
    "train_images_per_s_by_epoch": [5800.0, 6200.0],
}


@pytest.fixture(scope="module")
def script():
    pytest.importorskip("timm")
    pytest.importorskip("vit_pytorch")
    sys.path.insert(0, str(ROOT / "scripts"))  # it imports its sibling benchmark.py
    try:
        spec = importlib.util.spec_from_file_location(
            "train_vs_peers", ROOT / "scripts" / "train_vs_peers.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return module


def test_the_peers_get_the_runs_architecture_batch_and_precision(script):
    spec = script.peer_arch(METRICS)
    assert spec == {
        "embed_dim": 64,
        "depth": 6,
        "num_heads": 4,
        "mlp_dim": 128,
        "patch": 7,
        "batch": 256,
        "bf16": True,
    }
    assert script.peer_arch({**METRICS, "precision": "32-true"})["bf16"] is False
    # The benchmark's default architecture is the default run's.
    arch = {k: spec[k] for k in ("embed_dim", "depth", "num_heads", "mlp_dim")}
    assert arch == script.bench.ARCHS["default"]


@pytest.mark.parametrize(
    "change, match",
    [
        ({"in_chans": 3}, "3 x 28"),
        ({"num_classes": 47}, "47 classes"),
        ({"causal": True}, "causal"),
    ],
)
def test_a_model_the_peers_cannot_match_is_refused(script, change, match):
    metrics = {**METRICS, "model": {**METRICS["model"], **change}}
    with pytest.raises(ValueError, match=match):
        script.peer_arch(metrics)


def test_the_peers_loop_times_both_peers(script):
    spec = {**script.peer_arch(METRICS), "batch": 4, "bf16": False, "depth": 1}
    speeds = script.time_peers(spec, steps=1, reps=2, warmup=0)
    assert set(speeds) == {"timm", "vit-pytorch"} and min(speeds.values()) > 0


def test_the_peers_loop_runs_for_the_seconds_asked(script, monkeypatch):
    spec = {**script.peer_arch(METRICS), "batch": 4, "bf16": False, "depth": 1}
    clock = iter(range(10_000))  # every reading of the clock one "second" after the last
    monkeypatch.setattr(script.time, "perf_counter", lambda: float(next(clock)))
    calls = []
    timed = script.bench.Trainer.timed
    monkeypatch.setattr(script.bench.Trainer, "timed", lambda t, n: calls.append(n) or timed(t, n))
    speeds = script.time_peers(spec, steps=1, reps=1, warmup=0, seconds=20)
    # More than the one repetition asked for: rounds of both peers until 20 "seconds" passed.
    assert len(calls) > 2 and len(calls) % 2 == 0
    assert set(speeds) == {"timm", "vit-pytorch"} and min(speeds.values()) > 0


def test_each_pairs_peers_run_as_long_as_its_run_trained(script, monkeypatch):
    runs = iter([{**METRICS, "train_time_s": 30.0}, {**METRICS, "train_time_s": 50.0}])
    monkeypatch.setattr(script.speedrun, "run_train_py", lambda out, overrides: next(runs))
    asked = []
    peers = {"timm": 1000.0, "vit-pytorch": 4000.0}
    monkeypatch.setattr(script, "run_peers", lambda spec, args, s: asked.append(s) or peers)
    args = script.argparse.Namespace(pairs=2, epochs=1, overrides=[], peer_seconds=None)
    pairs = script.run_pairs(args)
    # Pair 1 trains first (30 s); pair 2's peers go first, as long as pair 1's run.
    assert asked == [30.0, 30.0] and [p["ratio"] for p in pairs] == [1.5, 1.5]
    runs = iter([{**METRICS, "train_time_s": 30.0}])
    asked.clear()
    script.run_pairs(script.argparse.Namespace(pairs=1, epochs=1, overrides=[], peer_seconds=2.0))
    assert asked == [2.0]


def test_the_section_gives_each_pair_and_the_median_ratio(script):
    spec = script.peer_arch(METRICS)
    pairs = [
        {"metrics": METRICS, "spec": spec, "peers": {"timm": 1000, "vit-pytorch": 4000}},
        {"metrics": METRICS, "spec": spec, "peers": {"timm": 1000, "vit-pytorch": 5000}},
        {"metrics": METRICS, "spec": spec, "peers": {"timm": 3000, "vit-pytorch": 2000}},
    ]
    for p in pairs:
        p["ratio"] = p["metrics"]["train_images_per_s"] / max(p["peers"].values())
    text = script.markdown_section(pairs, "python scripts/train_vs_peers.py", [], epochs=2)
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" | ")[-1] for r in rows] == ["1.50 |", "1.20 |", "2.00 |"]
    assert "5,800, 6,200" in rows[0]
    assert "Median ratio **1.50x** (pairs 1.20x to 2.00x)" in text
    assert text.startswith("## CPU: ") and "python train.py against the peers" in text


def test_bad_input_exits_2_with_the_reason(script, capsys, monkeypatch):
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        script.main(["--pairs", "0"])
    assert exit_.value.code == 2 and "--pairs=0: give 1 or more" in capsys.readouterr().err
    # A train.py that fails (here an override of a key that does not exist) stops the
    # comparison with train.py's own message, not a traceback.
    assert script.main(["--pairs", "1", "model.no_such_key=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no_such_key" in err
