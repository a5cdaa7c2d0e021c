"""Full evaluation, head importance, and prediction on a person's own images."""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import compose_config
from tests.helpers import in_process
from tests.test_distributed import read_events
from tests.test_train import check_run
from vit_mnist.analysis.heads import heads_zeroed
from vit_mnist.data.images import mnist_preprocess
from vit_mnist.data.synthetic import SyntheticDataModule
from vit_mnist.errors import CheckpointError, ConfigError
from vit_mnist.models import VisionTransformer
from vit_mnist.tasks.evaluate import evaluate
from vit_mnist.tasks.predict import predict_images
from vit_mnist.tasks.train import train
from vit_mnist.training.checkpointing import (
    checkpoint_datamodule,
    load_model,
    read_checkpoint,
    resolve_ckpt_path,
)
from vit_mnist.training.module import RUN_INFO_KEY, ViTClassifier

MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def count_tiles(png: Path, n_cols: int = 20) -> int:
    """Cells of misclassified.png that hold a picture (not plain white)."""
    a = np.asarray(Image.open(png).convert("L")).astype(int)
    cell_h, cell_w = 28 * 3 + 14, 28 * 3 + 4
    top = a.shape[0] - cell_h * ((a.shape[0] - 16) // cell_h)
    count = 0
    for r in range((a.shape[0] - top) // cell_h):
        for c in range(n_cols):
            y, x = top + r * cell_h + 13, c * cell_w + 2
            if (a[y : y + 84, x : x + 84] < 255).any():
                count += 1
    return count


def has_tile_grid(png: Path, rows: int, cols: int, tile: int = 84) -> bool:
    """Whether a ``labelled_grid`` picture holds exactly rows x cols tiles: each cell not
    plain white, and white just outside the grid (where one more row or column would be)."""
    a = np.asarray(Image.open(png).convert("L"))
    body = a[-(tile + 2) * rows - 3 :, -(tile + 2) * cols - 3 :]
    cells = [
        body[3 + r * (tile + 2) : 3 + r * (tile + 2) + tile, 3 + c * (tile + 2) :][:, :tile]
        for r in range(rows)
        for c in range(cols)
    ]
    return bool((body[0] == 255).all() and (body[:, 0] == 255).all()) and all(
        (cell < 255).any() for cell in cells
    )


@pytest.fixture(scope="module")
def synthetic_ckpt(tmp_path_factory):
    from tests.conftest import TINY_MODEL

    out = tmp_path_factory.mktemp("synthetic_run")
    overrides = ["data=synthetic", "trainer=cpu", "trainer.max_epochs=1", *TINY_MODEL]
    # A fixed path and precision: timing them (speed.path=auto) has tests of its own.
    overrides += ["speed.path=handwritten", "trainer.precision=32-true"]
    metrics = train(compose_config("train", overrides, out))
    return Path(metrics["best_ckpt"]), metrics


def test_eval_writes_every_report(synthetic_ckpt, tmp_path):
    ckpt, train_metrics = synthetic_ckpt
    cfg = compose_config("eval", [f"ckpt_path={ckpt}", "trainer=cpu"], tmp_path)
    metrics = evaluate(cfg)
    assert metrics["test/acc"] == train_metrics["test/acc"]
    for name in ("metrics.json", "per_class.csv", "confusion_matrix.png", "misclassified.png"):
        assert (tmp_path / name).is_file(), name
    cm = torch.tensor(metrics["confusion_matrix"])
    assert cm.sum() == metrics["num_test_images"] == 128
    assert cm.trace() == round(metrics["test/acc"] * 128)
    rows = list(csv.DictReader((tmp_path / "per_class.csv").open()))
    assert [int(r["support"]) for r in rows] == cm.sum(dim=1).tolist()
    errors = 128 - int(cm.trace())
    assert metrics["num_misclassified"] == metrics["misclassified_tiles"] == errors
    assert count_tiles(tmp_path / "misclassified.png") == errors
    # Columns: the first 16 errors; rows: input, relevance of the true and predicted class.
    assert 0 < metrics["misclassified_relevance_columns"] == min(16, errors)
    assert has_tile_grid(tmp_path / "misclassified_relevance.png", 3, min(16, errors))
    assert not has_tile_grid(tmp_path / "misclassified_relevance.png", 3, min(16, errors) - 1)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_a_checkpoint_of_an_earlier_version_evaluates_as_before(synthetic_ckpt, tmp_path):
    # Earlier versions stored no model.stem / stem_channels: the textbook patch embedding.
    ckpt, train_metrics = synthetic_ckpt
    stored = torch.load(ckpt, map_location="cpu", weights_only=True)
    model = stored["hyper_parameters"]["model"]
    assert model.pop("stem") == "patch" and "stem_channels" in model
    del model["stem_channels"]
    old = tmp_path / "old.ckpt"
    torch.save(stored, old)
    metrics = evaluate(compose_config("eval", [f"ckpt_path={old}", "trainer=cpu"], tmp_path))
    assert metrics["test/acc"] == train_metrics["test/acc"]


def test_gpu_float16_checkpoint_evaluates_on_cpu(synthetic_ckpt, tmp_path):
    ckpt, train_metrics = synthetic_ckpt
    saved = torch.load(ckpt, weights_only=True)
    saved["vit_mnist"]["precision"] = "16-mixed"  # as written by a run on a GPU
    gpu_ckpt = tmp_path / "gpu.ckpt"
    torch.save(saved, gpu_ckpt)
    cfg = compose_config("eval", [f"ckpt_path={gpu_ckpt}", "trainer=cpu"], tmp_path / "eval")
    metrics = evaluate(cfg)
    assert metrics["precision"] == "32-true"
    # The same figures as the untouched checkpoint evaluated in float32.
    fp32 = evaluate(
        compose_config(
            "eval", [f"ckpt_path={ckpt}", "trainer=cpu", "precision=32-true"], tmp_path / "e32"
        )
    )
    assert metrics["test/acc"] == fp32["test/acc"]


def test_data_keys_given_to_eval_change_the_checkpoints_dataset(synthetic_ckpt, tmp_path):
    # `+data.batch_size=16` keeps the dataset the checkpoint stores and changes that key
    # (before, the bare {batch_size: 16} was "instantiated" and Lightning failed on it).
    ckpt, _ = synthetic_ckpt
    run_info = read_checkpoint(ckpt)[RUN_INFO_KEY]
    assert run_info["data"]["batch_size"] != 16
    cfg = compose_config("eval", [f"ckpt_path={ckpt}", "+data.batch_size=16"], tmp_path)
    datamodule = checkpoint_datamodule(cfg, ckpt, run_info)
    assert isinstance(datamodule, SyntheticDataModule) and datamodule.batch_size == 16
    assert datamodule.sizes[2] == run_info["data"]["num_test"]
    # A key the stored data module does not take is named, as for any data module.
    cfg = compose_config("eval", [f"ckpt_path={ckpt}", "+data.fast=false"], tmp_path)
    with pytest.raises(ConfigError, match="data.fast is not an argument of .*SyntheticData"):
        checkpoint_datamodule(cfg, ckpt, run_info)


def test_head_importance(synthetic_ckpt, tmp_path):
    ckpt, _ = synthetic_ckpt
    cfg = compose_config("eval", [f"ckpt_path={ckpt}", "trainer=cpu", "analysis=heads"], tmp_path)
    metrics = evaluate(cfg)
    rows = list(csv.DictReader((tmp_path / "head_importance.csv").open()))
    assert [(int(r["layer"]), int(r["head"])) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in rows:
        assert 0 <= float(r["acc"]) <= 1
        assert 0 <= float(r["entropy_nats"]) <= np.log(17) + 1e-4
        assert float(r["mean_distance_px"]) > 0
        assert float(r["grad_importance"]) >= 0
    assert metrics["head_importance"]["baseline"]["acc"] == pytest.approx(metrics["test/acc"])
    assert -1 <= metrics["heads/spearman_grad_vs_ablation"] <= 1
    assert (tmp_path / "head_importance.png").is_file()


def test_every_trainer_of_an_evaluation_runs_on_the_resolved_device(
    synthetic_ckpt, tmp_path, monkeypatch
):
    """The heads analysis' quiet trainer takes the device the test loop resolved, not
    ``trainer.accelerator`` as written (with ``auto``, Lightning could pick MPS for it)."""
    import vit_mnist.tasks.evaluate.report as evaluate_module

    # "gpu" as written: a trainer built from it raises on this machine, which has none.
    monkeypatch.setattr(evaluate_module, "resolve_accelerator", lambda accelerator: "cpu")
    ckpt, _ = synthetic_ckpt
    overrides = [f"ckpt_path={ckpt}", "trainer.accelerator=gpu", "analysis=heads"]
    metrics = evaluate(compose_config("eval", overrides, tmp_path))
    assert metrics["head_importance"]["baseline"]["acc"] == pytest.approx(metrics["test/acc"])


def test_roles_analysis_on_the_validation_images(synthetic_ckpt, tmp_path):
    """eval.py analysis=roles: every head's role figures and per-class ablation, in
    roles.csv, roles.png, metrics.json and TensorBoard; on split=val as on test."""
    from vit_mnist.analysis.roles import ROLE_COLUMNS

    ckpt, _ = synthetic_ckpt
    overrides = [f"ckpt_path={ckpt}", "trainer=cpu", "analysis=roles", "split=val"]
    metrics = evaluate(compose_config("eval", overrides, tmp_path))
    rows = list(csv.DictReader((tmp_path / "roles.csv").open()))
    assert [(int(r["layer"]), int(r["head"])) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    classes = [f"acc_drop_{c}" for c in range(10)]
    assert list(rows[0]) == [
        "layer",
        "head",
        *ROLE_COLUMNS,
        "acc_drop",
        *classes,
        "most_hurt_class",
    ]
    for r in rows:
        for share, area in (("ink_share", "ink_area"), ("end_share", "end_area")):
            assert 0 <= float(r[share]) <= 1 and 0 <= float(r[area]) <= 1
        assert 0 <= float(r["entropy_nats"]) <= np.log(17) + 1e-4
        drops = [float(r[c]) for c in classes]
        assert r["most_hurt_class"] == str(int(np.argmax(drops)))
        assert all(-1 <= d <= 1 for d in drops)
    assert metrics["head_roles"][0]["ink_share"] == pytest.approx(float(rows[0]["ink_share"]))
    assert metrics["num_val_images"] == 128
    for name in ("roles.png", "roles_parts.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG"), name
    series, _ = read_events(tmp_path)
    assert "roles/ink_share/layer_1/head_1" in series
    assert "roles/acc_drop/layer_0/head_0" in series


def test_circuits_analysis(synthetic_ckpt, tmp_path):
    """eval.py analysis=circuits: per-component attribution, the lens and patching between
    the chosen classes, in CSV, PNG, metrics.json and TensorBoard; on split=val too."""
    ckpt, _ = synthetic_ckpt
    overrides = [f"ckpt_path={ckpt}", "trainer=cpu", "analysis=circuits", "split=val"]
    overrides += ["circuits.pairs=[[0,1]]", "circuits.pair_images=3"]
    metrics = evaluate(compose_config("eval", overrides, tmp_path))
    rows = list(csv.DictReader((tmp_path / "circuits_heads.csv").open()))
    components = [r["component"] for r in rows]
    assert components == [
        "embed", "L0H0", "L0H1", "L0 mlp", "L1H0", "L1H1", "L1 mlp", "biases"
    ]  # fmt: skip
    assert all(r["entropy_nats"] for r in rows if r["head"]) and not rows[0]["entropy_nats"]
    assert len(rows[0]) == 3 + 3 + 20 + 2
    lens = list(csv.DictReader((tmp_path / "circuits_lens.csv").open()))
    assert [int(r["layer"]) for r in lens] == [0, 1]
    assert metrics["circuits/lens_agreement"][-1] == 1.0
    assert metrics["circuits/lens_accuracy"][-1] == pytest.approx(metrics["val/acc"], abs=0.01)
    assert metrics["circuits/pairs"] == [["0", "1", 3]]
    patching = list(csv.DictReader((tmp_path / "circuits_patching.csv").open()))
    kinds = {(r["direction"], r["kind"]) for r in patching}
    assert len(kinds) == 10
    whole = [float(r["score"]) for r in patching if r["kind"] == "resid_all"]
    assert whole == pytest.approx([1.0] * 4, abs=1e-3)  # 2 layers x 2 directions
    for name in ("attribution", "lens", "patching", "patching_tokens"):
        assert (tmp_path / f"circuits_{name}.png").read_bytes().startswith(b"\x89PNG"), name
    series, _ = read_events(tmp_path)
    assert "circuits/to_margin/layer_1/head_1" in series
    assert "circuits/lens_accuracy" in series


def test_circuits_with_no_pair_to_patch_writes_the_header(synthetic_ckpt, tmp_path, monkeypatch):
    """No correctly classified image of a pair's classes: a warning, and a patching file of
    its header alone (it raised IndexError)."""
    import vit_mnist.tasks.evaluate.analyses as evaluate_module

    real = evaluate_module.logit_lens

    def nothing_right(model, images, labels):
        lens = real(model, images, labels)
        lens.predictions[:, -1] = -1
        return lens

    monkeypatch.setattr(evaluate_module, "logit_lens", nothing_right)
    ckpt, _ = synthetic_ckpt
    overrides = [f"ckpt_path={ckpt}", "trainer=cpu", "analysis=circuits", "split=val"]
    metrics = evaluate(compose_config("eval", overrides + ["circuits.pairs=[[0,1]]"], tmp_path))
    assert metrics["circuits/pairs"] == []
    header = (tmp_path / "circuits_patching.csv").read_text().splitlines()
    assert header == ["clean,corrupted,pairs,direction,kind,layer,head,token,score"]
    assert not (tmp_path / "circuits_patching.png").exists()


def test_circuits_refuses_a_class_the_model_lacks(synthetic_ckpt, tmp_path):
    ckpt, _ = synthetic_ckpt
    overrides = [f"ckpt_path={ckpt}", "trainer=cpu", "analysis=circuits", "circuits.pairs=[[3,12]]"]
    with pytest.raises(ConfigError, match=r"class 12 in \[3, 12\] is outside 0..9"):
        evaluate(compose_config("eval", overrides, tmp_path))
    assert not (tmp_path / "metrics.json").exists()


def test_faithfulness_analysis(synthetic_ckpt, tmp_path):
    ckpt, _ = synthetic_ckpt
    overrides = [f"ckpt_path={ckpt}", "trainer=cpu", "analysis=faithfulness"]
    cfg = compose_config("eval", [*overrides, "faithfulness.num_images=32"], tmp_path)
    metrics = evaluate(cfg)
    rows = list(csv.DictReader((tmp_path / "faithfulness.csv").open()))
    assert [r["method"] for r in rows] == ["attention", "rollout", "relevance", "random"]
    assert list(rows[0]) == ["method", "positive_auc", "negative_auc"]
    assert metrics["faithfulness/num_images"] == 32
    for r in rows:
        for key in ("positive_auc", "negative_auc"):
            assert 0 <= float(r[key]) <= 1
            assert metrics[f"faithfulness/{r['method']}/{key}"] == pytest.approx(float(r[key]))
    assert (tmp_path / "faithfulness.png").is_file()
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert (
        saved["faithfulness/relevance/positive_auc"]
        == metrics["faithfulness/relevance/positive_auc"]
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in (tmp_path / "tensorboard").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events), size_guidance={"images": 0, "scalars": 0})
        acc.Reload()
        tags |= set(acc.Tags()["images"]) | set(acc.Tags()["scalars"])
    assert {
        "faithfulness",
        "faithfulness/relevance/positive_auc",
        "misclassified_relevance",
    } <= tags
    with pytest.raises(ValueError, match=r"analysis=nonsense is not one of \['null', 'heads'"):
        evaluate(compose_config("eval", [*overrides[:2], "analysis=nonsense"], tmp_path / "x"))

    # The README's relevance picture is drawn from a checkpoint by this script.
    from scripts.relevance_figure import main as relevance_figure

    assert relevance_figure([str(ckpt), "--out", str(tmp_path / "r.png"), "--digits", "3"]) == 0
    with Image.open(tmp_path / "r.png") as picture:
        assert picture.width > 3 * 84 and picture.height > 4 * 84


def test_heads_zeroed_removes_exactly_that_head():
    torch.manual_seed(0)
    model = VisionTransformer(embed_dim=16, depth=2, num_heads=4, patch_size=7).eval()
    x = torch.randn(3, 1, 28, 28)
    before = model(x)
    with heads_zeroed(model, 1, [2]):
        ablated = model(x)
    torch.testing.assert_close(model(x), before)  # the hook is gone afterwards
    assert not torch.allclose(ablated, before)
    # Same as removing head 2's columns from W^O.
    with torch.no_grad():
        model.blocks[1].attn.proj.weight[:, 8:12] = 0
    torch.testing.assert_close(model(x), ablated)


def test_ckpt_path_latest_picks_newest_best(tmp_path):
    cfg = compose_config("eval", ["ckpt_path=latest"], tmp_path / "eval")
    cfg.paths.log_dir = str(tmp_path / "outputs")
    old = tmp_path / "outputs/train/runs/a/checkpoints/best-epoch001-val_acc0.9.ckpt"
    new = tmp_path / "outputs/train/runs/b/checkpoints/best-epoch003-val_acc0.8.ckpt"
    for i, path in enumerate((old, new)):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
        os.utime(path, (time.time() - 100 + i, time.time() - 100 + i))
    (new.parent / "last.ckpt").write_bytes(b"x")
    assert resolve_ckpt_path(cfg) == new


def test_preprocess_recovers_an_mnist_style_digit():
    digit = torch.zeros(28, 28)
    digit[6:22, 12:16] = 1.0  # a "1", centred
    photo = Image.fromarray((255 - digit.numpy() * 255).astype(np.uint8)).resize((300, 300))
    x = mnist_preprocess(photo)
    assert x.shape == (1, 28, 28) and 0 <= x.min() and x.max() <= 1
    ys, xs = torch.nonzero(x[0] > 0.5, as_tuple=True)
    assert ys.max() - ys.min() + 1 in (19, 20, 21)  # the tall side fits the 20-pixel box
    mass = x[0].sum()
    cy = (torch.arange(28)[:, None] * x[0]).sum() / mass
    cx = (torch.arange(28)[None, :] * x[0]).sum() / mass
    # Integer shifts: within half a pixel of (14, 14).
    assert abs(cy - 14) <= 0.51 and abs(cx - 14) <= 0.51
    with pytest.raises(ValueError, match="blank"):
        mnist_preprocess(Image.new("L", (50, 50), 255))


@pytest.mark.real_data
def test_real_mnist_eval_and_prediction_on_saved_images(mnist_dir, tmp_path):
    cfg = compose_config(
        "train",
        ["trainer=cpu", "trainer.max_epochs=1", "model.depth=2", "model.embed_dim=48"]
        # 500 batches of 64 (32,000 images): test accuracy 0.894 in 13 s of training on one
        # AVX2 thread, against 0.918 in 21 s for 2 epochs of 170 batches of 256.
        + ["data.batch_size=64", "trainer.limit_train_batches=500"]
        + ["module.lr=4e-3", "module.warmup_epochs=0.5", "data.augment=null"]
        + ["speed.path=handwritten", "trainer.precision=32-true"],  # not timed: see test_speed
        tmp_path / "train",
    )
    metrics = train(cfg)
    print("real-MNIST test accuracy:", metrics["test/acc"])
    # The whole pipeline on real data: run dir, metrics.json, TensorBoard scalars.
    check_run(tmp_path / "train", metrics, epochs=1)
    assert metrics["dataset"] == "mnist" and metrics["data_source"]
    assert metrics["test/acc"] > 0.85

    eval_cfg = compose_config("eval", ["ckpt_path=" + metrics["best_ckpt"]], tmp_path / "eval")
    result = evaluate(eval_cfg)
    assert result["test/acc"] == metrics["test/acc"]
    cm = torch.tensor(result["confusion_matrix"])
    assert cm.sum(dim=1).tolist() == MNIST_TEST_COUNTS
    assert result["num_misclassified"] == 10_000 - int(cm.trace())

    # Ten test digits, one per class, saved as a person's photo would be: dark ink on
    # white paper, three times larger (each pixel a 3 x 3 block, so that scaling back down
    # gives the test image's pixels and the predictions can be compared exactly).
    module, data = load_model(metrics["best_ckpt"])
    from vit_mnist.data import MNISTDataModule

    dm = MNISTDataModule(data_dir=str(mnist_dir))
    dm.setup()
    x, y = dm.data_test.tensors
    x = dm.data_test.normalise(x)
    # For each class the test digit the model is surest of: the saved picture is
    # re-cropped and re-centred by the predictor, which must not change a clear answer
    # (a borderline digit could go either way).
    with torch.no_grad():
        probs = module(x).softmax(1)
    picks = [int(torch.where(y == c, probs[:, c], -1.0).argmax()) for c in range(10)]
    expected = list(range(10))
    paths = []
    for c, i in enumerate(picks):
        raw = (x[i, 0] * data["std"] + data["mean"]).clamp(0, 1).mul(255).round().byte().numpy()
        path = tmp_path / f"digit_{c}.png"
        Image.fromarray(255 - raw).resize((84, 84), Image.NEAREST).save(path)
        paths.append(path)
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 not really a jpeg")
    results = predict_images(module, [*paths, broken], tmp_path / "pred")
    assert [r.top[0][0] for r in results[:10]] == [str(c) for c in expected]
    assert results[10].path == broken and results[10].error and results[10].top == []
    for r in results[:10]:
        assert len(r.top) == 3 and r.picture.is_file()
        assert (tmp_path / "pred" / f"{r.path.stem}_28x28.png").is_file()
    assert (
        json.loads((tmp_path / "eval" / "metrics.json").read_text())["test/acc"]
        == result["test/acc"]
    )


def test_test_time_shift_averages_the_softmax_of_nine_shifted_copies():
    torch.manual_seed(0)
    model = {"embed_dim": 16, "depth": 1, "num_heads": 2, "patch_size": 7, "mlp_ratio": 1.0}
    module = ViTClassifier(model=model, test_time_shift=2).eval()
    x = torch.randn(3, 1, 28, 28)
    scores, logits = module._shift_averaged(x, module.net)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2), mode="replicate")
    views = [
        padded[..., 2 + dy : 30 + dy, 2 + dx : 30 + dx] for dy in (-2, 0, 2) for dx in (-2, 0, 2)
    ]
    # A shift by (dx, dy) moves pixel (r, c) to (r + dy, c + dx), edge pixels repeated.
    assert torch.equal(views[0][..., 2:, 2:], x[..., :-2, :-2])
    expected = torch.stack([module.net(v).softmax(-1) for v in views]).mean(0).log()
    torch.testing.assert_close(scores, expected)
    torch.testing.assert_close(logits, module.net(x))
    assert torch.allclose(scores.exp().sum(-1), torch.ones(3))
    module.hparams.test_time_shift = 0
    plain_scores, plain_logits = module._shift_averaged(x, module.net)
    assert plain_scores is plain_logits  # (a shift's range: tests/test_settings.py)


def test_eval_on_the_validation_split_with_a_test_time_shift(synthetic_ckpt, tmp_path):
    ckpt, train_metrics = synthetic_ckpt
    args = [f"ckpt_path={ckpt}", "trainer=cpu", "split=val"]
    shifted = evaluate(compose_config("eval", [*args, "test_time_shift=1"], tmp_path / "tta"))
    assert shifted["split"] == "val" and shifted["test_time_shift"] == 1
    assert shifted["num_val_images"] == 128 and "test/acc" not in shifted
    # The unshifted images alone: the validation accuracy the training run logged.
    saved = torch.load(ckpt, weights_only=True)
    assert shifted["val/acc_one_view"] == pytest.approx(saved["val_acc_best"])
    written = json.loads((tmp_path / "tta" / "metrics.json").read_text())
    assert written["val/acc"] == shifted["val/acc"]
    with pytest.raises(ConfigError, match="split=val"):
        evaluate(compose_config("eval", [*args, "analysis=heads"], tmp_path / "heads"))
    with pytest.raises(ConfigError, match=r"split=train is not one of \['test', 'val'\]"):
        evaluate(compose_config("eval", [f"ckpt_path={ckpt}", "split=train"], tmp_path / "x"))


@pytest.mark.parametrize("task", ["evaluate", "predict", "export"])
def test_a_checkpoint_with_nan_weights_is_one_line_naming_it(
    synthetic_ckpt, tmp_path, monkeypatch, capsys, task
):
    # Not truncated, one weight corrupted: eval reported 9.8% with a NaN loss, then an
    # IndexError traceback while drawing.
    ckpt = torch.load(synthetic_ckpt[0], weights_only=True)
    ckpt["state_dict"]["net.head.bias"][3] = float("nan")
    damaged = tmp_path / "damaged.ckpt"
    torch.save(ckpt, damaged)
    images = ["images=[digit.png]"] if task == "predict" else []
    run_dir = tmp_path / "run"
    code, _, err = in_process(
        monkeypatch, capsys, f"ckpt_path={damaged}", *images, f"hydra.run.dir={run_dir}", task=task
    )
    assert code == 2, err[-2000:]
    assert err.strip().splitlines() == [
        f"error: checkpoint {damaged} is damaged: net.head.bias holds 1 NaN or infinite value(s) "
        "of 10; use another checkpoint of the run, e.g. its last.ckpt or best-*.ckpt"
    ]
    assert not {p.name for p in run_dir.glob("*")} - {".hydra", f"{task}.log", "eval.log"}


def test_finite_weights_that_give_a_non_finite_loss_are_damaged_too(synthetic_ckpt, tmp_path):
    ckpt = torch.load(synthetic_ckpt[0], weights_only=True)
    ckpt["state_dict"]["net.head.weight"] *= 1e38  # finite, but the logits overflow
    damaged = tmp_path / "huge.ckpt"
    torch.save(ckpt, damaged)
    cfg = compose_config("eval", [f"ckpt_path={damaged}", "trainer=cpu"], tmp_path / "run")
    with pytest.raises(CheckpointError, match=f"checkpoint {damaged} is damaged: its finite"):
        evaluate(cfg)
    assert not (tmp_path / "run" / "metrics.json").exists()


@pytest.mark.parametrize(
    ("sig", "status", "name"), [("SIGINT", 130, "Ctrl-C"), ("SIGTERM", 143, "SIGTERM")]
)
def test_a_stop_while_eval_draws_is_one_line_naming_what_is_complete(
    synthetic_ckpt, tmp_path, monkeypatch, capsys, sig, status, name
):
    # Ctrl-C while eval.py drew its figures was a 75-line traceback, no metrics.json and no
    # word that the run was incomplete.
    import signal

    from vit_mnist import cli
    from vit_mnist.tasks.evaluate import analyses as evaluate_module

    def stopped_while_drawing(*args, **kwargs):
        os.kill(os.getpid(), getattr(signal, sig))

    monkeypatch.setattr(evaluate_module, "save_figure", stopped_while_drawing)
    monkeypatch.setattr(cli.os, "_exit", lambda code: None)  # the stop goes on as SystemExit
    run_dir = tmp_path / "run"
    code, _, err = in_process(
        monkeypatch,
        capsys,
        f"ckpt_path={synthetic_ckpt[0]}",
        f"hydra.run.dir={run_dir}",
        "trainer=cpu",
        task="evaluate",
    )
    assert code == status and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"Stopped by {name} during evaluate.py; complete in {run_dir}: misclassified.png, "
        "misclassified_relevance.png, per_class.csv; nothing else was written."
    )
    assert not (run_dir / "metrics.json").exists()
