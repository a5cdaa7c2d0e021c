"""DeiT's distillation token (model.distillation=true, module.teacher_ckpt=PATH) and the
convnet teacher (model=cnn, experiment=cnn_teacher)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY_MODEL, compose_config
from vit_mnist.analysis.distillation import cls_dist_similarity
from vit_mnist.errors import CheckpointError, ConfigError
from vit_mnist.models.vit import VisionTransformer
from vit_mnist.tasks.evaluate import evaluate
from vit_mnist.tasks.train import train
from vit_mnist.training.checkpointing import read_checkpoint
from vit_mnist.training.distillation import distillation_loss
from vit_mnist.training.module import RUN_INFO_KEY, ViTClassifier

TINY = dict(patch_size=7, embed_dim=32, depth=2, num_heads=2)


def test_distillation_off_is_the_textbook_model():
    torch.manual_seed(0)
    textbook = VisionTransformer(**TINY)
    torch.manual_seed(0)
    off = VisionTransformer(**TINY, distillation=False)
    assert off.state_dict().keys() == textbook.state_dict().keys()
    for key, value in textbook.state_dict().items():
        assert torch.equal(off.state_dict()[key], value), key
    x = torch.randn(3, 1, 28, 28)
    assert torch.equal(off(x), textbook(x))
    assert off.num_prefix_tokens == 1 and off.dist_token is None and off.head_dist is None


def test_distilled_model_predicts_the_two_heads_softmax_averaged():
    torch.manual_seed(0)
    net = VisionTransformer(**TINY, distillation=True).eval()
    assert net.num_prefix_tokens == 2 and net.num_tokens == 2 + 16
    x = torch.randn(3, 1, 28, 28)
    tokens = net.forward_features(x)
    cls, dist = net.forward_heads(tokens)
    assert torch.equal(cls, net.head(tokens[:, 0])) and torch.equal(
        dist, net.head_dist(tokens[:, 1])
    )
    expected = (cls.softmax(-1) + dist.softmax(-1)) / 2
    torch.testing.assert_close(net(x).softmax(-1), expected)
    # The attention weights cover the distillation token too (T = 2 + 16).
    _, weights = net.forward_with_attention(x)
    assert weights[0].shape == (3, 2, 18, 18)


def test_hard_distillation_loss_is_the_hand_computation():
    cls = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    dist = torch.tensor([[0.0, 3.0, 0.0], [1.0, 1.0, 1.0]])
    labels = torch.tensor([0, 1])
    teacher = torch.tensor([[0.1, 0.9, 0.0], [0.0, 0.2, 0.7]])  # hard labels 1 and 2

    def nll(logits: list[float], k: int) -> float:  # -log softmax(logits)_k
        return -logits[k] + math.log(sum(math.exp(v) for v in logits))

    true_term = (nll([2, 0, 0], 0) + nll([0, 1, 0], 1)) / 2
    teacher_term = (nll([0, 3, 0], 1) + nll([1, 1, 1], 2)) / 2
    loss = distillation_loss(cls, dist, labels, teacher)
    assert loss.item() == pytest.approx((true_term + teacher_term) / 2, rel=1e-6)
    # Label smoothing eps on the true labels only: (1 - eps) * nll + eps * mean over classes.
    eps = 0.3
    smoothed = [
        (1 - eps) * nll(row, k) + eps * sum(nll(row, c) for c in range(3)) / 3
        for row, k in (([2, 0, 0], 0), ([0, 1, 0], 1))
    ]
    loss = distillation_loss(cls, dist, labels, teacher, label_smoothing=eps)
    assert loss.item() == pytest.approx((sum(smoothed) / 2 + teacher_term) / 2, rel=1e-6)


def test_soft_distillation_loss_is_the_hand_computation():
    cls, dist = torch.tensor([[2.0, 0.0, 0.0]]), torch.tensor([[0.0, 3.0, 0.0]])
    labels, teacher = torch.tensor([0]), torch.tensor([[0.0, 4.0, 2.0]])
    tau = 2.0

    def softmax(logits: list[float]) -> list[float]:
        e = [math.exp(v / tau) for v in logits]
        return [v / sum(e) for v in e]

    p, q = softmax([0.0, 4.0, 2.0]), softmax([0.0, 3.0, 0.0])  # teacher, student
    kl = sum(pc * math.log(pc / qc) for pc, qc in zip(p, q, strict=True))
    true_term = -2.0 + math.log(math.exp(2) + 2)
    loss = distillation_loss(cls, dist, labels, teacher, tau=tau)
    assert loss.item() == pytest.approx((true_term + tau**2 * kl) / 2, rel=1e-6)
    # A student that says what the teacher says leaves the true labels' half alone; the
    # hard loss would still charge it the cross-entropy of the teacher's argmax.
    agreeing = distillation_loss(cls, teacher, labels, teacher, tau=tau)
    assert agreeing.item() == pytest.approx(true_term / 2, abs=1e-6)
    assert distillation_loss(cls, teacher, labels, teacher).item() > agreeing.item() + 0.05


@pytest.mark.filterwarnings("ignore:You are trying to `self.log")  # no Trainer: a bare step
def test_the_training_step_learns_the_teachers_labels_with_the_distillation_head():
    torch.manual_seed(0)
    module = ViTClassifier(model={**TINY, "distillation": True}, label_smoothing=0.1)
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3])
    teacher_logits = torch.randn(4, 10)
    module.teacher = lambda images: teacher_logits  # what on_fit_start loads from the file
    loss = module.training_step((x, y), 0)
    heads = module.net.forward_heads(module.net.forward_features(x))
    assert loss.item() == distillation_loss(*heads, y, teacher_logits, 0.1).item()
    module.hparams.distillation_tau = 3.0  # softened outputs instead of the hard labels
    soft = distillation_loss(*heads, y, teacher_logits, 0.1, tau=3.0)
    assert module.training_step((x, y), 0).item() == soft.item() != loss.item()
    module.teacher = None  # without a teacher: cross-entropy of the averaged prediction
    plain = torch.nn.functional.cross_entropy(module.net(x), y, label_smoothing=0.1)
    assert module.training_step((x, y), 0).item() == pytest.approx(plain.item(), rel=1e-6)


def _train(out: Path, *overrides: str) -> dict:
    base = ["data=synthetic", "trainer=cpu", "trainer.max_epochs=1", "seed=1"]
    base += ["speed.path=reference", "trainer.precision=32-true"]
    model = [] if "model=cnn" in overrides else TINY_MODEL
    return train(compose_config("train", [*base, *model, *overrides], out))


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """(teacher checkpoint, student checkpoint, student metrics): the convnet teaches a tiny
    distilled ViT on synthetic data."""
    out = tmp_path_factory.mktemp("distillation")
    teacher = Path(_train(out / "teacher", "model=cnn")["best_ckpt"])
    metrics = _train(
        out / "student", "model.distillation=true", f"module.teacher_ckpt={teacher}", "seed=2"
    )
    return teacher, Path(metrics["best_ckpt"]), metrics


def test_a_student_trains_from_its_teacher_and_keeps_only_its_own_weights(distilled):
    teacher, student, metrics = distilled
    ckpt = read_checkpoint(student)
    assert ckpt["hyper_parameters"]["model"]["distillation"] is True
    assert ckpt["hyper_parameters"]["teacher_ckpt"] == str(teacher)
    keys = ckpt["state_dict"].keys()
    assert {"net.dist_token", "net.head_dist.weight"} <= keys
    assert not [k for k in keys if "teacher" in k]
    assert metrics["speed_path"] == "reference" and 0 <= metrics["test/acc"] <= 1
    # Which teacher, of which data, how good: in metrics.json and in the student's checkpoint.
    taught_by = json.loads((teacher.parent.parent / "metrics.json").read_text())
    assert metrics["teacher"] == {
        "ckpt": str(teacher),
        "dataset": "synthetic",
        "val_acc_best": read_checkpoint(teacher)["val_acc_best"],
        "test_acc": taught_by["test/acc"],
    }
    assert ckpt[RUN_INFO_KEY]["teacher"] == metrics["teacher"]
    written = json.loads((student.parent.parent / "metrics.json").read_text())
    assert written["teacher"] == metrics["teacher"]


def test_a_teacher_of_another_dataset_is_refused_before_any_work(
    distilled, make_train_cfg, tmp_path
):
    # Fashion-MNIST and MNIST have the same shapes and class count: a Fashion-MNIST convnet
    # distilled an MNIST student without a word.
    teacher, _, _ = distilled
    ckpt = torch.load(teacher, weights_only=True)
    ckpt[RUN_INFO_KEY]["data"]["_target_"] = "vit_mnist.data.FashionMNISTDataModule"
    foreign = tmp_path / "fashion_teacher.ckpt"
    torch.save(ckpt, foreign)
    cfg = make_train_cfg("model.distillation=true", f"module.teacher_ckpt={foreign}")
    with pytest.raises(ConfigError) as error:
        train(cfg)
    assert str(error.value) == (
        f"module.teacher_ckpt={foreign} was trained on fashion_mnist, this run trains on "
        "synthetic: give a teacher trained on synthetic (experiment=cnn_teacher data=synthetic)"
    )
    assert not (tmp_path / "train").exists()


@pytest.mark.parametrize("analysis", [None, "heads", "faithfulness", "roles", "prune"])
def test_every_analysis_runs_on_a_distilled_checkpoint(distilled, tmp_path, analysis):
    _, student, metrics = distilled
    overrides = [f"ckpt_path={student}", "trainer=cpu", "faithfulness.num_images=16"]
    overrides += [f"analysis={analysis}"] if analysis else []
    result = evaluate(compose_config("eval", overrides, tmp_path))
    # The checkpoint's own figure, without the teacher (it is needed for training only).
    assert result["test/acc"] == metrics["test/acc"]
    similarity = result["cls_dist_cosine_by_layer"]  # the input, then each of 2 blocks
    assert len(similarity) == 3 and all(-1 <= s <= 1 for s in similarity)
    assert (tmp_path / "metrics.json").is_file()


def test_predict_export_and_explorer_take_the_distillation_token(distilled, tmp_path):
    from PIL import Image, ImageDraw

    from vit_mnist.tasks.explore import Explorer
    from vit_mnist.tasks.export import export
    from vit_mnist.tasks.predict import predict_images
    from vit_mnist.training.checkpointing import load_model

    _, student, _ = distilled
    module, _ = load_model(student)
    image = tmp_path / "digit.png"
    picture = Image.new("L", (56, 56), 255)  # a dark stroke on white paper, as a photo
    ImageDraw.Draw(picture).line([(28, 8), (28, 48)], fill=0, width=5)
    picture.save(image)
    (result,) = predict_images(module, [image], tmp_path / "pred")
    assert len(result.top) == 3 and result.picture.is_file()
    export(compose_config("export", [f"ckpt_path={student}", "format=torchscript"], tmp_path))
    explorer = Explorer(model=module.net)
    # The query token 1 is the distillation token; the patches start at token 2.
    assert explorer.token_at(0, 0) == 2
    view = explorer.view(torch.zeros(1, 1, 28, 28), token=1)
    assert view is not None


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["model.distillation=true"], ["model.distillation=true needs a teacher"]),
        (["module.teacher_ckpt=TEACHER"], ["add model.distillation=true"]),
        (
            ["model.distillation=true", "module.teacher_ckpt=TEACHER", "model.num_classes=5"],
            ["num_classes=10", "model.num_classes=5"],
        ),
        (["model.distillation=true", "module.teacher_ckpt=/no/such.ckpt"], ["/no/such.ckpt"]),
        (["module.distillation_tau=3"], ["module.distillation_tau=3", "add module.teacher_ckpt"]),
        (["module.distillation_tau=0"], ["module.distillation_tau=0"]),
    ],
)
def test_distillation_settings_are_checked_before_any_work(
    distilled, make_train_cfg, overrides, words, tmp_path
):
    teacher, _, _ = distilled
    overrides = [o.replace("TEACHER", str(teacher)) for o in overrides]
    with pytest.raises((ConfigError, CheckpointError)) as error:
        train(make_train_cfg(*overrides))
    assert all(w in str(error.value) for w in words), str(error.value)
    assert not (tmp_path / "train" / "checkpoints").exists()


def test_the_tokens_similarity_is_their_cosine_at_the_input_and_after_each_block():
    torch.manual_seed(0)
    net = VisionTransformer(**TINY, distillation=True)
    with torch.no_grad():  # two equal tokens, and no position embedding to tell them apart
        net.dist_token.copy_(net.cls_token)
        net.pos_embed.zero_()
    assert cls_dist_similarity(net, torch.randn(5, 1, 28, 28)) == pytest.approx([1.0] * 3)
    with torch.no_grad():
        net.dist_token.copy_(-net.cls_token)
    assert cls_dist_similarity(net, torch.randn(5, 1, 28, 28))[0] == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="no distillation token"):
        cls_dist_similarity(VisionTransformer(**TINY), torch.randn(1, 1, 28, 28))


def test_the_attention_panel_shows_the_distillation_tokens_rows_under_the_cls_tokens(distilled):
    from tests.test_attention_maps import tile_rows
    from vit_mnist.analysis.attention import attention_report
    from vit_mnist.training.checkpointing import load_model

    module, _ = load_model(distilled[1])
    torch.manual_seed(0)
    report = attention_report(module.net, torch.randn(2, 1, 28, 28), relevance=False)
    heads = 2
    for picture in report.layer_grids:
        rows = tile_rows(picture, cols=2, rows=2 * heads)  # CLS heads, then dist. heads
        assert picture.shape[1] >= 86 * 2 * heads
        assert not torch.equal(rows[0], rows[heads])


def test_the_convnet_teacher_trains_evaluates_and_predicts_like_any_checkpoint(distilled, tmp_path):
    from PIL import Image, ImageDraw

    from vit_mnist.tasks.predict import predict_images
    from vit_mnist.training.checkpointing import load_model

    teacher, _, _ = distilled
    assert read_checkpoint(teacher)["hyper_parameters"]["model"]["arch"] == "cnn"
    metrics = evaluate(compose_config("eval", [f"ckpt_path={teacher}", "trainer=cpu"], tmp_path))
    assert 0 <= metrics["test/acc"] <= 1 and (tmp_path / "per_class.csv").is_file()
    assert metrics["misclassified_relevance_columns"] == 0  # no attention to explain
    module, _ = load_model(teacher)
    image = tmp_path / "digit.png"
    picture = Image.new("L", (56, 56), 255)
    ImageDraw.Draw(picture).line([(28, 8), (28, 48)], fill=0, width=5)
    picture.save(image)
    (result,) = predict_images(module, [image], tmp_path / "pred")
    assert len(result.top) == 3 and result.picture is None
    assert (tmp_path / "pred" / "digit_28x28.png").is_file()


def test_what_studies_attention_refuses_the_convnet_in_one_line(distilled, tmp_path):
    from vit_mnist.tasks.explore import load_explorer

    teacher, _, _ = distilled
    cfg = compose_config("eval", [f"ckpt_path={teacher}", "analysis=heads"], tmp_path / "e")
    with pytest.raises(ConfigError, match="is a convnet .model=cnn.: leave analysis out"):
        evaluate(cfg)
    with pytest.raises(ConfigError, match="is a convnet .model=cnn.: the explorer"):
        load_explorer(compose_config("explore", [f"ckpt_path={teacher}"], tmp_path / "x"))


def test_the_convnet_runs_on_the_reference_path_alone():
    from vit_mnist.models import ConvNet
    from vit_mnist.speed.choose import candidates

    pairs, skipped = candidates(torch.device("cpu"), "auto", "32-true", True, ConvNet())
    assert pairs == [("reference", "32-true")]
    assert all("convnet" in why for name, why in skipped.items() if name != "compile")
    with pytest.raises(ConfigError, match="convnet"):
        candidates(torch.device("cpu"), "handwritten", "32-true", False, ConvNet())
