"""The Hydra configs compose and build with the overrides users type."""

from __future__ import annotations

import hydra
import lightning as L
import pytest

from tests.conftest import compose_config
from vit_mnist.training.module import ViTClassifier

ISSUE_OVERRIDES = [
    "model.num_heads=8",
    "model.embed_dim=128",
    "model.depth=4",
    "model.patch_size=7",
    "trainer=cpu",
    "trainer.max_epochs=3",
    "data.batch_size=256",
    "seed=7",
]


def test_default_train_config(tmp_path):
    cfg = compose_config("train", [], tmp_path)
    assert cfg.trainer.accelerator == "auto"
    assert cfg.data._target_.endswith("MNISTDataModule")
    assert cfg.callbacks.model_checkpoint.monitor == "val/acc"
    assert cfg.paths.data_dir.endswith("data")


def test_overrides_compose_and_build(tmp_path):
    cfg = compose_config("train", ISSUE_OVERRIDES, tmp_path)
    assert (cfg.model.num_heads, cfg.model.embed_dim, cfg.model.depth, cfg.model.patch_size) == (
        8,
        128,
        4,
        7,
    )
    assert cfg.trainer.accelerator == "cpu" and cfg.trainer.max_epochs == 3
    assert cfg.data.batch_size == 256 and cfg.seed == 7
    module = hydra.utils.instantiate(cfg.module, model=dict(cfg.model), _convert_="all")
    assert isinstance(module, ViTClassifier)
    assert module.net.blocks[0].attn.head_dim == 16
    assert len(module.net.blocks) == 4
    datamodule = hydra.utils.instantiate(cfg.data)
    assert datamodule.batch_size == 256
    # precision: auto is made concrete by train(), from the speed layer's measurement.
    assert cfg.trainer.precision == "auto"
    trainer = hydra.utils.instantiate(
        cfg.trainer, logger=False, enable_checkpointing=False, precision="32-true"
    )
    assert isinstance(trainer, L.Trainer) and trainer.max_epochs == 3


@pytest.mark.parametrize("trainer_group", ["cpu", "default"])
def test_bf16_mixed_precision_composes_on_cpu(tmp_path, trainer_group):
    cfg = compose_config(
        "train",
        [f"trainer={trainer_group}", "trainer.accelerator=cpu", "trainer.precision=bf16-mixed"],
        tmp_path,
    )
    trainer = hydra.utils.instantiate(cfg.trainer, logger=False, enable_checkpointing=False)
    assert trainer.precision == "bf16-mixed"


def test_gpu_trainer_inherits_default(tmp_path):
    cfg = compose_config("train", ["trainer=gpu"], tmp_path)
    assert cfg.trainer.accelerator == "gpu"
    assert cfg.trainer.max_epochs == compose_config("train", [], tmp_path).trainer.max_epochs


def test_eval_config_requires_ckpt_path(tmp_path):
    from omegaconf import OmegaConf

    cfg = compose_config("eval", [], tmp_path)
    assert OmegaConf.is_missing(cfg, "ckpt_path")
