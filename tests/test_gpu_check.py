"""scripts/gpu_check.py: one line and exit 0 without CUDA; its commands are valid settings."""

from __future__ import annotations

import pytest
import torch

from scripts.gpu_check import NO_CUDA, main, steps
from tests.conftest import compose_config
from vit_mnist.settings import SETTINGS, check_settings


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_it_prints_one_line_and_exits_0(capsys):
    assert main([]) == 0  # the script's exit status (sys.exit(main()))
    out, err = capsys.readouterr()
    assert out.strip().splitlines() == [NO_CUDA] and not err


def test_every_training_command_of_the_check_is_valid(tmp_path):
    train, _, _, _, speedrun = steps(tmp_path, speedrun_seeds=10)
    overrides = [a for a in train.command if "=" in a and not a.startswith("hydra.")]
    check_settings(compose_config("train", overrides, tmp_path), SETTINGS["train"])
    seed_overrides = [a for a in speedrun.command if "=" in a]
    cfg = compose_config("train", ["experiment=speedrun", *seed_overrides], tmp_path)
    check_settings(cfg, SETTINGS["train"])
    assert cfg.trainer.devices == 1 and "strategy" not in cfg.trainer  # one process
    assert "--seeds" in speedrun.command and "10" in speedrun.command
