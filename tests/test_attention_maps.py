"""Attention maps, rollout, head statistics, and the TensorBoard callback."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from vit_mnist.analysis.attention import (
    attention_entropy,
    attention_report,
    attention_rollout,
    cls_attention,
    mean_attention_distance,
)
from vit_mnist.analysis.relevance import class_relevance
from vit_mnist.models import VisionTransformer
from vit_mnist.tasks.train import train

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


def tile_rows(picture: torch.Tensor, cols: int, rows: int, tile: int = 84) -> list[torch.Tensor]:
    """The rows of tiles of a ``labelled_grid`` picture (the grid is its bottom right)."""
    body = picture[:, -(tile + 2) * rows - 2 :, -(tile + 2) * cols - 2 :]
    return [body[:, 2 + r * (tile + 2) : (r + 1) * (tile + 2)] for r in range(rows)]


def test_report_shapes_and_training_mode_restored():
    model = VisionTransformer(**TINY, dropout=0.1).train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    images = torch.randn(3, 1, 28, 28)
    report = attention_report(model, images, torch.tensor([1, 2, 3]))
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    # Two rows: the rollout as without relevance, then the predicted class's relevance.
    plain = attention_report(model, images, relevance=False).rollout
    assert report.relevance.shape == (3, 4, 4)
    torch.testing.assert_close(report.relevance, class_relevance(model, images)[0])
    rollout_row, relevance_row = tile_rows(report.rollout, 3, 2)
    assert torch.equal(rollout_row, tile_rows(plain, 3, 1)[0])
    assert not torch.equal(rollout_row, relevance_row)
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
            if tag == "rollout":
                rollout_png = acc.Images(tag)[-1].encoded_image_string
        for tag in acc.Tags()["scalars"]:
            scalars[tag] = scalars.get(tag, 0) + len(acc.Scalars(tag))
    epochs = 2  # logged after each epoch; the end of fitting adds nothing new
    for layer in range(2):
        assert images[f"attention/layer_{layer}"] == epochs
        for head in range(2):
            assert images[f"attention_matrix/layer_{layer}/head_{head}"] == epochs
            assert scalars[f"attention_entropy/layer_{layer}/head_{head}"] == epochs
            assert scalars[f"attention_distance/layer_{layer}/head_{head}"] == epochs
    assert images["rollout"] == images["attribution"] == epochs
    # The rollout picture's second row is the relevance, computed inside fit; causal: the
    # CLS token sees only itself, and both rows are the same constant 0 map.
    with Image.open(io.BytesIO(rollout_png)) as picture:
        rollout = torch.from_numpy(np.array(picture.convert("RGB"))).permute(2, 0, 1)
    rows = tile_rows(rollout, 10, 2)
    assert torch.equal(rows[0], rows[1]) == bool(extra)
    assert "attention/layer_2" not in images

    # The README's picture is made from these event files.
    from scripts.attention_figure import main as make_figure

    out = Path(cfg.paths.output_dir) / "attention.png"
    assert make_figure([cfg.paths.output_dir, "--out", str(out)]) == 0
    with Image.open(out) as picture:
        assert picture.width > 200 and picture.height > 200
