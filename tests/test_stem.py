"""The hybrid's convolutional stem (model.stem=conv) beside the textbook patch embedding."""

from __future__ import annotations

import hashlib

import pytest
import torch

from tests.conftest import TINY_MODEL, compose_config
from vit_mnist.analysis import attention_report, class_relevance, heads_switched_off
from vit_mnist.analysis.logit_attribution import direct_logit_attribution
from vit_mnist.analysis.roles import head_roles
from vit_mnist.errors import ConfigError
from vit_mnist.models import VisionTransformer
from vit_mnist.tasks.evaluate import evaluate
from vit_mnist.tasks.export import export
from vit_mnist.tasks.train import train
from vit_mnist.training.checkpointing import model_differences


def test_the_textbook_model_is_unchanged_by_the_stem_option():
    # Parameter names and shapes, and the outputs of a seeded model, as before model.stem.
    torch.manual_seed(0)
    model = VisionTransformer(patch_size=7).eval()
    names = ";".join(f"{n}:{tuple(p.shape)}" for n, p in model.state_dict().items())
    assert hashlib.sha256(names.encode()).hexdigest()[:16] == "425456325a8d9a89"
    x = torch.linspace(-1, 1, 2 * 28 * 28).view(2, 1, 28, 28)
    with torch.no_grad():
        logits = model(x)
    expected = [0.09089546650648117, -0.07524328678846359, 0.07937172055244446]
    torch.testing.assert_close(logits[0, :3], torch.tensor(expected), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("patch", "strides", "field", "tokens", "built"),
    [
        (4, None, 7, 50, [2, 2]),
        (7, None, 11, 17, [1, 1]),
        (14, None, 19, 5, [2, 1]),
        (4, [1, 2], 7, 50, [1, 2]),  # a convolution at 28 x 28, the projection steps by 2
        (4, [2, 1], 9, 50, [2, 1]),  # one at 14 x 14
    ],
)
def test_a_conv_stem_makes_the_same_token_grid_with_a_wider_view(
    patch, strides, field, tokens, built
):
    # Receptive field: each 3x3 convolution adds 2 jumps (a jump: the product of the strides
    # before it, in pixels); the projection adds (kernel - 1) jumps. Patch 4: 1 + 2 + 4 = 7
    # px; patch 7 (no stride 2): 1 + 2 + 2 + 6 = 11; strides [1, 2]: 1 + 2 + 2 + 2 = 7;
    # strides [2, 1]: 1 + 2 + 4 + 2 = 9.
    model = VisionTransformer(
        patch_size=patch, stem="conv", stem_channels=[8, 16], stem_strides=strides
    )
    convs = [m for m in model.patch_embed.convs if isinstance(m, torch.nn.Conv2d)]
    assert [m.stride[0] for m in convs] == built
    assert model.patch_embed.receptive_field == field
    assert model.num_tokens == tokens and model.patch_embed.grid_size == 28 // patch
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 10)


@pytest.mark.parametrize("strides", [None, [2, 1, 2]])
def test_every_analysis_runs_on_a_conv_stem(strides):
    torch.manual_seed(0)
    model = VisionTransformer(
        embed_dim=16,
        depth=2,
        num_heads=2,
        patch_size=4,
        stem="conv",
        stem_channels=[8, 16, 16] if strides else [8, 16],
        stem_strides=strides,
    ).eval()
    x = torch.randn(4, 1, 28, 28)
    report = attention_report(model, x, torch.arange(4))
    assert report.weights[0].shape == (4, 2, 50, 50) and report.relevance.shape == (4, 7, 7)
    relevance, _ = class_relevance(model, x, 3)
    assert relevance.shape == (4, 7, 7) and (relevance >= 0).all()
    with torch.no_grad():
        full = model(x)
        with heads_switched_off(model, [(1, 0)]):
            assert not torch.allclose(model(x), full)
    attribution = direct_logit_attribution(model, x)
    torch.testing.assert_close(attribution.contributions.sum(1), full, atol=1e-4, rtol=0)
    rows = head_roles(model, x, x.sigmoid())
    assert len(rows) == 4


def test_a_conv_stem_trains_evaluates_and_exports(tmp_path):
    pytest.importorskip("onnxruntime")
    overrides = ["data=synthetic", "trainer=cpu", "trainer.max_epochs=1", *TINY_MODEL]
    overrides += ["model.stem=conv", "model.stem_channels=[8,16,16]", "model.patch_size=4"]
    overrides += ["model.stem_strides=[2,1,2]"]  # a convolution at 14 x 14
    overrides += ["speed.path=reference", "trainer.precision=32-true"]
    metrics = train(compose_config("train", overrides, tmp_path / "train"))
    ckpt = metrics["best_ckpt"]
    evaluated = evaluate(compose_config("eval", [f"ckpt_path={ckpt}", "trainer=cpu"], tmp_path))
    assert evaluated["test/acc"] == metrics["test/acc"]
    exported = export(
        compose_config(
            "export", [f"ckpt_path={ckpt}", "format=onnx", "check_images=50"], tmp_path / "x"
        )
    )
    assert exported["max_abs_diff"] < 1e-4 and exported["classes_agree"] == 50


def test_stem_channels_without_the_conv_stem_is_refused_not_ignored(tmp_path):
    overrides = ["data=synthetic", "trainer=cpu", *TINY_MODEL, "model.stem_channels=[16,32]"]
    with pytest.raises(ConfigError, match=r"^model.stem_channels=\[16, 32\]: used by the conv"):
        train(compose_config("train", overrides, tmp_path))
    # Both keys named at once, each with the null that clears it (an experiment sets both).
    both = [*overrides, "model.stem_strides=[2,2]"]
    with pytest.raises(ConfigError) as refused:
        train(compose_config("train", both, tmp_path))
    assert str(refused.value).endswith(
        "add model.stem_channels=null model.stem_strides=null (the experiment or model config"
        " may be what set them)"
    )
    # The default, null, gives the conv stem its own channels.
    stem = VisionTransformer(patch_size=4, stem="conv", stem_channels=None).patch_embed
    assert [m.out_channels for m in stem.convs if isinstance(m, torch.nn.Conv2d)] == [32, 64]
    # Checkpoints of 2026-11-28 stored stem_channels=[32, 64] beside stem=patch: they build.
    torch.manual_seed(0)
    state = VisionTransformer(patch_size=7).state_dict()
    torch.manual_seed(0)
    stored = VisionTransformer(patch_size=7, stem="patch", stem_channels=[32, 64]).state_dict()
    assert stored.keys() == state.keys()
    assert all(torch.equal(stored[k], state[k]) for k in state)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model.stem=conv", "model.patch_size=4", "model.stem_strides=[2]"],
            r"^model.stem_strides=\[2\] needs one stride per convolution of "
            r"model.stem_channels=\[32, 64\]: give 2",
        ),
        (
            ["model.stem=conv", "model.patch_size=4", "model.stem_strides=[2,4]"],
            r"^model.stem_strides=\[2, 4\] step by 8 pixels in all, which does not divide "
            r"patch_size=4",
        ),
        (
            ["model.stem=conv", "model.stem_strides=[0,2]"],
            r"^model.stem_strides=\[0,2\]: each value must be >= 1",
        ),
        (["model.stem_strides=[2,2]"], r"^model.stem_strides=\[2, 2\]: used by the conv"),
    ],
)
def test_stem_strides_are_checked_before_any_work(tmp_path, overrides, message):
    overrides = ["data=synthetic", "trainer=cpu", *TINY_MODEL, *overrides]
    cfg = compose_config("train", overrides, tmp_path)
    with pytest.raises(ConfigError, match=message):
        train(cfg)
    assert not (tmp_path / "metrics.json").exists()


def test_stem_channels_differ_only_where_the_network_uses_them():
    # Resume and ckpt_path=latest compare the stored model with the config's.
    old, new = {"stem_channels": [32, 64]}, {"stem_channels": None}
    patch, conv = {"patch_size": 7, "stem": "patch"}, {"patch_size": 4, "stem": "conv"}
    assert model_differences(patch | old, patch | new) == []
    assert model_differences(conv | old, conv | new) == []
    assert model_differences(conv | {"stem_channels": [32, 64, 128]}, conv) == [
        "model.stem_channels: [32, 64, 128] (checkpoint) vs [32, 64] (config)"
    ]
    # A checkpoint from before stem_strides built the strides that null builds now, and
    # only those.
    assert model_differences(conv | old, conv | {"stem_strides": [2, 2]}) == []
    assert model_differences(conv | old, conv | {"stem_strides": [2, 1]}) == [
        "model.stem_strides: [2, 2] (checkpoint) vs [2, 1] (config)"
    ]
    assert model_differences(patch | old, patch | {"stem_strides": None}) == []


def test_a_conv_stem_with_no_convolution_is_refused_not_trained_as_the_patch_stem(tmp_path):
    """Issue 102: `model.stem=conv 'model.stem_channels=[]' 'model.stem_strides=[]'` trained
    the patch stem's 205 962 parameters while every record said conv."""
    overrides = ["data=synthetic", "trainer=cpu", *TINY_MODEL, "model.stem=conv"]
    empty = [*overrides, "model.stem_channels=[]", "model.stem_strides=[]"]
    with pytest.raises(ConfigError, match=r"^model.stem_channels=\[\] must not be empty"):
        train(compose_config("train", empty, tmp_path))
    assert not (tmp_path / "metrics.json").exists()
    # A Python caller (or a checkpoint) gets the same refusal from the constructor.
    with pytest.raises(ConfigError, match="no convolution, which is the patch stem"):
        VisionTransformer(patch_size=4, stem="conv", stem_channels=[], stem_strides=[])


def test_a_stem_given_to_the_convnet_is_refused_in_one_line(tmp_path):
    # Issue 102's audit of the stem: `model=cnn +model.stem=conv` was a TypeError traceback.
    overrides = ["data=synthetic", "trainer=cpu", "model=cnn", "+model.stem=conv"]
    with pytest.raises(ConfigError, match=r"^model.stem: not a setting of the convnet"):
        train(compose_config("train", overrides, tmp_path))
    assert not (tmp_path / "metrics.json").exists()
