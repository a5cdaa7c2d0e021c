"""A run dir written before the package's rooms moved (issue 100) still evaluates, resumes,
predicts and opens in the explorer, though its ``.hydra/config.yaml`` names the old module
paths (``vit_mnist.module.ViTClassifier``, ``vit_mnist.callbacks.*``,
``vit_mnist.checkpointing.AtomicCheckpointIO``).

The fixture ``fixtures/run_d52c075.tar.gz`` is that run dir, without its TensorBoard
events: written by commit d52c075 with
``python train.py experiment=smoke model.embed_dim=16 model.depth=1 model.num_heads=2
model.mlp_ratio=1.0 data.num_train=64 data.num_val=32 data.num_test=32 speed.path=reference
callbacks.progress_bar=null hydra.run.dir=/tmp/fixture_run``.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import ROOT, compose_config
from tests.helpers import in_process
from tests.test_predict import draw_digit

FIXTURE = ROOT / "tests" / "fixtures" / "run_d52c075.tar.gz"


@pytest.fixture
def old_run(tmp_path) -> Path:
    with tarfile.open(FIXTURE) as archive:
        archive.extractall(tmp_path, filter="data")
    return tmp_path / "run"


def test_the_fixture_names_the_old_module_paths(old_run):
    config = yaml.safe_load((old_run / ".hydra" / "config.yaml").read_text())
    assert config["module"]["_target_"] == "vit_mnist.module.ViTClassifier"
    assert config["callbacks"]["attention_maps"]["_target_"].startswith("vit_mnist.callbacks.")


def test_an_old_run_evaluates_to_its_own_accuracy(old_run, tmp_path, monkeypatch, capsys):
    metrics = json.loads((old_run / "metrics.json").read_text())
    (best,) = (old_run / "checkpoints").glob("best-*.ckpt")
    code, out, err = in_process(
        monkeypatch,
        capsys,
        f"ckpt_path={best}",
        f"hydra.run.dir={tmp_path / 'eval'}",
        task="evaluate",
    )
    assert code == 0, err[-3000:]
    evaluated = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert evaluated["test/acc"] == pytest.approx(metrics["test/acc"])


def test_an_old_run_resumes_from_its_own_config(old_run, tmp_path, monkeypatch, capsys):
    """``-cp <run>/.hydra -cn config``: the run's own config, old ``_target_``s and all."""
    code, _, err = in_process(
        monkeypatch,
        capsys,
        "--config-path",
        str(old_run / ".hydra"),
        "--config-name",
        "config",
        f"ckpt_path={old_run / 'checkpoints' / 'last.ckpt'}",
        "trainer.max_epochs=2",
        f"hydra.run.dir={tmp_path / 'resumed'}",
    )
    assert code == 0, err[-3000:]
    resumed = json.loads((tmp_path / "resumed" / "metrics.json").read_text())
    assert resumed["epochs"] == 2 and resumed["global_steps"] == 2
    assert resumed["resumed_from"].endswith("last.ckpt")


def test_an_old_checkpoint_predicts_and_opens_in_the_explorer(
    old_run, tmp_path, monkeypatch, capsys
):
    from vit_mnist.tasks.explore import load_explorer

    best = next((old_run / "checkpoints").glob("best-*.ckpt"))
    digit = draw_digit(tmp_path / "seven.png", seed=7)
    code, _, err = in_process(
        monkeypatch,
        capsys,
        f"ckpt_path={best}",
        f"images=[{digit}]",
        f"hydra.run.dir={tmp_path / 'predict'}",
        task="predict",
    )
    assert code == 0, err[-3000:]
    assert (tmp_path / "predict" / "predictions.csv").read_text().count("seven.png") == 1
    explorer = load_explorer(compose_config("explore", [f"ckpt_path={best}"], tmp_path / "x"))
    view = explorer.view(explorer.examples[0][:1])
    assert view.explanation.probs.shape == (10,)


# The model arguments that checkpoints stored before the speed layer (commit 5e7ede0,
# 2026-11-23, configs/model/vit_tiny.yaml of its parent): no arch, stem or distillation,
# attention_impl "auto" and the retired compile key.
BEFORE_5E7EDE0 = (
    "img_size", "in_chans", "num_classes", "patch_size", "embed_dim", "depth", "num_heads",
    "mlp_ratio", "dropout", "attn_dropout", "causal", "qkv_bias", "drop_path_rate",
)  # fmt: skip


def _checkpoint_of(old_run: Path, version: str, folder: Path) -> Path:
    """The fixture run's best checkpoint as ``version`` wrote it: d52c075's as it is, and
    one with the model arguments stored before 5e7ede0, built from it."""
    (best,) = (old_run / "checkpoints").glob("best-*.ckpt")
    if version == "d52c075":
        return best
    ckpt = torch.load(best, map_location="cpu", weights_only=False)
    model = ckpt["hyper_parameters"]["model"]
    older = {k: model[k] for k in BEFORE_5E7EDE0}
    ckpt["hyper_parameters"]["model"] = {**older, "attention_impl": "auto", "compile": False}
    path = folder / "before_5e7ede0.ckpt"
    torch.save(ckpt, path)
    return path


@pytest.mark.parametrize(
    ("version", "analysis"),
    [("d52c075", "prune")]
    + [("before 5e7ede0", a) for a in ("heads", "faithfulness", "prune", "roles", "circuits")],
)
def test_every_analysis_runs_on_a_checkpoint_of_an_earlier_version(
    old_run, tmp_path, monkeypatch, capsys, analysis, version
):
    ckpt = _checkpoint_of(old_run, version, tmp_path)
    code, out, err = in_process(
        monkeypatch,
        capsys,
        f"ckpt_path={ckpt}",
        f"analysis={analysis}",
        "faithfulness.num_images=16",
        "circuits.pair_images=4",
        f"hydra.run.dir={tmp_path / 'eval'}",
        task="evaluate",
    )
    assert code == 0, (out + err)[-3000:]
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    expected = {
        "heads": "heads/spearman_grad_vs_ablation",
        "faithfulness": "faithfulness/num_images",
        "prune": "pruning/ckpt",
        "roles": "head_roles",
        "circuits": "circuits/lens_accuracy",
    }[analysis]
    assert expected in metrics
