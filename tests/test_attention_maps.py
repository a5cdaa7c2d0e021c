"""Attention maps, rollout, head statistics, and the TensorBoard callback."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from vit_mnist.analysis.attention import (
    attention_entropy,
    attention_report,
    attention_rollout,
    cls_attention,
    mean_attention_distance,
)
from vit_mnist.models import VisionTransformer
from vit_mnist.train import train

TINY = {"embed_dim": 32, "depth": 3, "num_heads": 4, "patch_size": 7}


def model_weights(model: VisionTransformer, batch: int) -> list[torch.Tensor]:
    torch.manual_seed(1)
    with torch.no_grad():
        return model.eval().forward_with_attention(torch.randn(batch, 1, 28, 28))[1]


@pytest.mark.parametrize("batch", [1, 5])
def test_attention_and_rollout_rows_sum_to_one(batch):
    weights = model_weights(VisionTransformer(**TINY), batch)
    for w in weights:
        torch.testing.assert_close(w.sum(-1), torch.ones(batch, 4, 17))
    rollout = attention_rollout(weights)
    assert rollout.shape == (batch, 17, 17)
    assert (rollout >= 0).all()
    torch.testing.assert_close(rollout.sum(-1), torch.ones(batch, 17))


def test_rollout_is_per_image():
    # A batch-size-1 implementation broadcasts one image's rollout to the others.
    weights = model_weights(VisionTransformer(**TINY), 3)
    batched = attention_rollout(weights)
    for i in range(3):
        torch.testing.assert_close(
            batched[i : i + 1], attention_rollout([w[i : i + 1] for w in weights])
        )


def test_rollout_of_uniform_attention_is_uniform_plus_residual():
    t = 5
    uniform = torch.full((2, 3, t, t), 1 / t)
    expected = (torch.full((t, t), 1 / t) + torch.eye(t)) / 2
    torch.testing.assert_close(attention_rollout([uniform])[0], expected)


def test_entropy_and_distance_on_known_patterns():
    g, p = 4, 7
    t = 1 + g * g
    uniform = torch.full((1, 1, t, t), 1 / t)
    one_hot = torch.eye(t).expand(1, 1, t, t)
    torch.testing.assert_close(attention_entropy(uniform), torch.tensor([math.log(t)]))
    torch.testing.assert_close(attention_entropy(one_hot), torch.tensor([0.0]))
    # Looking at yourself: distance 0. Looking at the right-hand neighbour: p pixels.
    assert mean_attention_distance(one_hot, grid_size=g, patch_size=p).item() == 0.0
    right = torch.zeros(1, 1, t, t)
    for q in range(g * g):
        r, c = divmod(q, g)
        right[0, 0, 1 + q, 1 + r * g + (c + 1 if c + 1 < g else c - 1)] = 1
    assert mean_attention_distance(right, grid_size=g, patch_size=p).item() == pytest.approx(p)


def test_maps_of_fused_model_equal_explicit_model():
    explicit = VisionTransformer(**TINY)
    fused = VisionTransformer(**TINY, attention_impl="fused")
    fused.load_state_dict(explicit.state_dict())
    images = torch.randn(4, 1, 28, 28)
    a, b = attention_report(explicit, images), attention_report(fused, images)
    assert len(b.weights) == 3
    for wa, wb in zip(a.weights, b.weights, strict=True):
        torch.testing.assert_close(wa, wb)
    for ga, gb in zip(a.layer_grids, b.layer_grids, strict=True):
        assert torch.equal(ga, gb)
    assert torch.equal(a.rollout, b.rollout)


def test_causal_maps_have_nothing_above_the_diagonal():
    report = attention_report(VisionTransformer(**TINY, causal=True), torch.randn(2, 1, 28, 28))
    above = torch.triu(torch.ones(17, 17, dtype=torch.bool), 1)
    for w in report.weights:
        assert (w[..., above] == 0).all()
    assert (attention_rollout(report.weights)[:, above] == 0).all()


def test_report_shapes_and_training_mode_restored():
    model = VisionTransformer(**TINY, dropout=0.1).train()
    report = attention_report(model, torch.randn(3, 1, 28, 28), torch.tensor([1, 2, 3]))
    assert model.training
    assert len(report.layer_grids) == 3 and len(report.matrices) == 3
    for grid in report.layer_grids:
        assert grid.dtype == torch.uint8 and grid.shape[0] == 3
    assert report.matrices[0][0].shape == (3, 17, 17)
    assert report.rollout.dtype == torch.uint8
    assert cls_attention(report.weights[0], 4).shape == (3, 4, 4, 4)
    assert report.entropy[0].shape == (4,) and report.distance[0].shape == (4,)


@pytest.mark.parametrize("extra", [[], ["model.attention_impl=fused", "model.causal=true"]])
def test_callback_logs_every_layer_and_head(make_train_cfg, extra):
    cfg = make_train_cfg("model.depth=2", "model.num_heads=2", *extra)
    train(cfg)
    events = sorted((Path(cfg.paths.output_dir) / "tensorboard").glob("events.out.tfevents.*"))
    images: dict[str, int] = {}
    scalars: dict[str, int] = {}
    for path in events:
        acc = EventAccumulator(str(path), size_guidance={"images": 0, "scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["images"]:
            images[tag] = images.get(tag, 0) + len(acc.Images(tag))
        for tag in acc.Tags()["scalars"]:
            scalars[tag] = scalars.get(tag, 0) + len(acc.Scalars(tag))
    epochs = 2  # logged after each epoch; the end of fitting adds nothing new
    for layer in range(2):
        assert images[f"attention/layer_{layer}"] == epochs
        for head in range(2):
            assert images[f"attention_matrix/layer_{layer}/head_{head}"] == epochs
            assert scalars[f"attention_entropy/layer_{layer}/head_{head}"] == epochs
            assert scalars[f"attention_distance/layer_{layer}/head_{head}"] == epochs
    assert images["rollout"] == epochs
    assert "attention/layer_2" not in images

    # The README's picture is made from these event files.
    from scripts.attention_figure import main as make_figure

    out = Path(cfg.paths.output_dir) / "attention.png"
    assert make_figure([cfg.paths.output_dir, "--out", str(out)]) == 0
    from PIL import Image

    with Image.open(out) as picture:
        assert picture.width > 200 and picture.height > 200
