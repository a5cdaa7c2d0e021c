"""End to end: train(cfg) -> checkpoints, TensorBoard scalars, metrics.json -> evaluate(cfg)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch._dynamo.utils import counters

from tests.conftest import compose_config
from tests.helpers import record_compiles
from vit_mnist.errors import CheckpointError, ConfigError
from vit_mnist.tasks.evaluate import evaluate
from vit_mnist.tasks.train import train
from vit_mnist.training.checkpointing import read_checkpoint
from vit_mnist.training.module import ViTClassifier

SCALARS = {
    "train/loss",
    "train/acc",
    "val/loss",
    "val/acc",
    "val/acc_best",
    "test/acc",
    "test/loss",
}


def scalar_tags(run_dir: Path) -> dict[str, list[float]]:
    values: dict[str, list[float]] = {}
    for events in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            values.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
    return values


def check_run(run_dir: Path, metrics: dict, epochs: int) -> Path:
    ckpts = run_dir / "checkpoints"
    best = sorted(ckpts.glob("best-*.ckpt"))
    assert len(best) == 1 and (ckpts / "last.ckpt").is_file()
    assert not list(ckpts.glob("last-v*.ckpt")), "two callbacks must share one last.ckpt"
    assert metrics["best_ckpt"] == str(best[0])

    written = json.loads((run_dir / "metrics.json").read_text())
    assert written == json.loads(json.dumps(metrics))
    for key in ("test/acc", "val/acc_best"):
        assert 0.0 <= written[key] <= 1.0
    assert written["num_params"] > 0 and written["train_time_s"] > 0
    # The speedrun's clock (first step to last) sits inside the whole fit.
    assert 0 < written["fit_time_s"] <= written["train_time_s"]
    assert written["train_images_per_s"] > 0
    by_epoch = written["train_images_per_s_by_epoch"]
    assert len(by_epoch) == epochs
    assert min(by_epoch) <= written["train_images_per_s"] <= max(by_epoch)
    assert written["device"].startswith("cpu")
    assert written["epochs"] == epochs

    tags = scalar_tags(run_dir)
    assert SCALARS <= set(tags), f"missing scalars: {SCALARS - set(tags)}"
    assert any(t.startswith("lr-") for t in tags), "learning rate not logged"
    assert len(tags["val/acc"]) == epochs
    assert tags["test/acc"][-1] == pytest.approx(written["test/acc"])
    assert tags["val/acc_best"][-1] == pytest.approx(max(tags["val/acc"]))
    assert (run_dir / "tensorboard" / "hparams.yaml").is_file()
    return best[0]


def test_train_synthetic_end_to_end_then_eval(make_train_cfg, tmp_path):
    cfg = make_train_cfg("module.lr=3e-3")
    metrics = train(cfg)
    run_dir = Path(cfg.paths.output_dir)
    best = check_run(run_dir, metrics, epochs=2)
    # A learnable task: well above the 10% of guessing after two epochs.
    assert metrics["test/acc"] > 0.5
    assert metrics["data_source"] == "synthetic"

    # The checkpoint alone rebuilds the model (weights_only load, no Hydra).
    ckpt = read_checkpoint(best)
    assert ckpt["hyper_parameters"]["model"]["embed_dim"] == 32
    model = ViTClassifier.load_from_checkpoint(best, map_location="cpu", weights_only=True)
    assert model.net.blocks[0].attn.num_heads == 2

    eval_cfg = compose_config("eval", [f"ckpt_path={best}", "trainer=cpu"], tmp_path / "eval")
    eval_metrics = evaluate(eval_cfg)
    assert eval_metrics["test/acc"] == metrics["test/acc"]
    assert (
        json.loads((tmp_path / "eval" / "metrics.json").read_text())["test/acc"]
        == metrics["test/acc"]
    )


def test_fused_attention_and_bf16_train(make_train_cfg):
    cfg = make_train_cfg(
        "model.attention_impl=fused", "trainer.precision=bf16-mixed", "trainer.max_epochs=1"
    )
    metrics = train(cfg)
    assert metrics["precision"] == "bf16-mixed"
    assert torch.isfinite(torch.tensor(metrics["test/loss"]))


@pytest.mark.isa
def test_auto_chooses_path_and_precision_by_measurement(make_train_cfg, one_round_auto):
    from vit_mnist.hardware import has_native_bf16

    overrides = ["speed.path=auto", "trainer.precision=auto", "trainer.max_epochs=1", "test=false"]
    first = train(make_train_cfg(*overrides))
    assert first["speed_choice"] == "measured"
    timed = first["speed_images_per_s"]
    assert first["speed_path"] + " " + first["precision"] == max(timed, key=timed.get)
    # bf16 is a candidate only where the hardware computes it.
    assert any("bf16" in k for k in timed) == has_native_bf16(False)


def test_accelerator_auto_trains_where_the_paths_were_timed(make_train_cfg, monkeypatch):
    # On an Apple-silicon Mac, Lightning's own `auto` takes MPS, while the paths and the
    # precision were timed on the CPU: the Trainer is given `cpu`. (Without the fix this
    # run tries MPS and fails.)
    from lightning.fabric.accelerators import mps as fabric_mps
    from lightning.pytorch.accelerators import mps

    from vit_mnist.hardware import resolve_accelerator

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for module in (fabric_mps, mps):
        monkeypatch.setattr(module.MPSAccelerator, "is_available", staticmethod(lambda: True))
    got = [resolve_accelerator(a) for a in ("auto", "cpu", "gpu", "cuda")]
    assert got == ["cpu", "cpu", "cuda", "cuda"]
    cfg = make_train_cfg("trainer.accelerator=auto", "trainer.max_epochs=1", "test=false")
    assert train(cfg)["device"].startswith("cpu (")


def test_compile_path_keeps_plain_checkpoints(make_train_cfg, monkeypatch):
    # The eager backend checks the wiring in a second instead of inductor's minute.
    compiled = record_compiles(monkeypatch, "eager")
    torch._dynamo.reset()
    counters.clear()
    cfg = make_train_cfg("speed.path=compile", "trainer.max_epochs=1")
    metrics = train(cfg)
    # The first training step compiles (no warm-up before fitting), and says how long.
    assert metrics["speed_path"] == "compile" and metrics["first_step_s"] > 0
    # One graph, the training step's: validation and test run eagerly. A second meant a
    # recompile, as when einops met the cls_token Parameter.
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert compiled == [{"dynamic": True, "mode": None}]
    state = read_checkpoint(metrics["best_ckpt"])["state_dict"]
    assert state and all(k.startswith("net.") for k in state)
    ViTClassifier.load_from_checkpoint(metrics["best_ckpt"], map_location="cpu", weights_only=True)


def test_model_compile_is_refused_with_the_new_setting(make_train_cfg):
    with pytest.raises(ConfigError, match=r"model.compile is no longer .* speed.path=compile"):
        train(make_train_cfg("+model.compile=true"))
    with pytest.raises(ConfigError, match=r"speed.cache is gone: .* speed.remeasure=true"):
        train(make_train_cfg("+speed.cache=false"))
    # The schema's choices are the speed layer's path names (and auto).
    with pytest.raises(ConfigError, match=r"speed.path=warp is not one of \['auto', 'reference'"):
        train(make_train_cfg("speed.path=warp"))


def test_compile_path_on_the_cpu_needs_a_cpp_compiler(make_train_cfg):
    import torch._inductor.config as inductor_config

    cfg = make_train_cfg("speed.path=compile", "trainer.accelerator=cpu")
    with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/g++")}):
        with pytest.raises(ConfigError, match=r"speed.path=compile cannot run here: no work"):
            train(cfg)


@pytest.mark.parametrize("content", [None, b"", b"garbage" * 10, b"hello\n", "folder"])
def test_eval_rejects_missing_truncated_or_foreign_checkpoint(tmp_path, content):
    # A text file made torch.load raise KeyError, and a folder read as "does not exist".
    path = tmp_path / "model.ckpt"
    if content == "folder":
        (path / "checkpoints").mkdir(parents=True)
        (path / "checkpoints" / "last.ckpt").write_bytes(b"")
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(CheckpointError, match=str(path)) as error:
        read_checkpoint(path)
    if content == "folder":
        assert "is a folder" in str(error.value) and "last.ckpt" in str(error.value)


def test_eval_rejects_foreign_torch_file(tmp_path):
    path = tmp_path / "foreign.pt"
    torch.save({"state_dict": {}, "epoch": 1}, path)
    with pytest.raises(CheckpointError, match="not a vit_mnist checkpoint"):
        read_checkpoint(path)


@pytest.mark.parametrize(
    ("threads", "processes", "expected"),
    [
        (2, 1, "cpu (CPU, AVX2, 2 threads)"),
        (1, 1, "cpu (CPU, AVX2, 1 thread)"),
        (1, 2, "cpu (CPU, AVX2, 2 processes x 1 thread)"),
        (4, 2, "cpu (CPU, AVX2, 2 processes x 4 threads)"),
    ],
)
def test_device_line_names_threads_and_processes(monkeypatch, threads, processes, expected):
    from vit_mnist import hardware

    monkeypatch.setattr(hardware, "cpu_name", lambda: "CPU")
    monkeypatch.setattr(hardware, "cpu_class", lambda: "AVX2")
    monkeypatch.setattr(hardware.torch, "get_num_threads", lambda: threads)
    assert hardware.describe_device(torch.device("cpu"), processes) == expected


def test_device_line_names_a_class_held_below_the_cpu(monkeypatch):
    # ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU: the results table must not file the run
    # under the CPU's own class.
    from vit_mnist import hardware

    monkeypatch.setattr(hardware, "cpu_name", lambda: "CPU")
    monkeypatch.setattr(hardware, "cpu_class", lambda: "AVX512-BF16")
    monkeypatch.setattr(hardware, "isa_class", lambda: "AVX2")
    monkeypatch.setattr(hardware.torch, "get_num_threads", lambda: 2)
    assert (
        hardware.describe_device(torch.device("cpu")) == "cpu (CPU, AVX2 on AVX512-BF16, 2 threads)"
    )


def test_schedule_epochs_makes_a_short_run_the_start_of_a_longer_one():
    from types import SimpleNamespace

    from vit_mnist.training.module import ViTClassifier

    def learning_rates(max_epochs: int, **module) -> list[float]:
        classifier = ViTClassifier(model={"patch_size": 7, "depth": 1}, lr=1.0, **module)
        classifier._trainer = SimpleNamespace(  # 10 steps an epoch
            estimated_stepping_batches=10 * max_epochs, max_epochs=max_epochs
        )
        scheduled = classifier.configure_optimizers()
        optimizer, scheduler = scheduled["optimizer"], scheduled["lr_scheduler"]["scheduler"]
        rates = []
        for _ in range(10 * max_epochs):
            rates.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return rates

    full = learning_rates(8)
    assert learning_rates(2, schedule_epochs=8) == full[:20]
    assert learning_rates(2) != full[:20]  # its own cosine, ended after 2 epochs


def test_the_model_summary_counts_flops_through_an_augmenting_datamodule(make_train_cfg, capsys):
    """The summary runs ViTClassifier.example_input_array (one image, for a FLOPs count that
    is not 0) through the datamodule's batch hook, which augments (images, labels) batches
    only: an augmenting run starts, and its summary names the FLOPs."""
    metrics = train(make_train_cfg("+data.augment={degrees:10.0,translate:0.1}"))
    assert metrics["epochs"] == 2
    assert re.search(r"Total FLOPs: [1-9]", capsys.readouterr().out)
