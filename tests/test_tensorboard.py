"""TensorBoard as a user sees it: its own server, asked over HTTP on the loopback."""

from __future__ import annotations

import json

import pytest

from tests.tensorboard_server import get_bytes, get_json, serve, wait_for_tags
from vit_mnist.tasks.train import train

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_tensorboard_serves_attention_maps_and_metrics(make_train_cfg, tmp_path):
    cfg = make_train_cfg(output_dir=tmp_path / "run")  # depth 2, 2 heads, 2 epochs
    metrics = train(cfg)
    maps = {"attention/layer_0", "attention/layer_1", "rollout"}
    maps |= {f"attention_matrix/layer_{layer}/head_{h}" for layer in (0, 1) for h in (0, 1)}
    wanted_scalars = {"train/loss", "val/acc", "val/acc_best", "test/acc", "lr-AdamW/pg1"}
    wanted_scalars |= {"attention_entropy/layer_1/head_1", "attention_distance/layer_0/head_0"}

    with serve(tmp_path / "run") as url:
        assert url.startswith("http://127.0.0.1:")
        images = wait_for_tags(url, "images", maps)
        scalar_tags = wait_for_tags(url, "scalars", wanted_scalars)
        (run,) = images  # one run: rank 0's tensorboard/ folder
        assert maps <= set(images[run])
        assert wanted_scalars <= set(scalar_tags[run])

        # One picture per validation epoch, and each is a PNG the browser can show.
        shots = get_json(url, "/data/plugin/images/images", run=run, tag="attention/layer_0")
        assert len(shots) == metrics["epochs"]
        blob = get_bytes(url, "/data/plugin/images/individualImage?" + shots[-1]["query"])
        assert blob.startswith(PNG)

        # The scalars TensorBoard shows are the ones metrics.json reports.
        for tag in ("val/acc_best", "test/acc"):
            points = get_json(url, "/data/plugin/scalars/scalars", run=run, tag=tag)
            assert points[-1][2] == pytest.approx(metrics[tag], abs=1e-6), tag
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["epochs"] == 2
