"""``evaluate(cfg)``: rebuild a model from its checkpoint alone and test it."""

from __future__ import annotations

import logging
import pickle
import zipfile
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from vit_mnist.errors import CheckpointError
from vit_mnist.module import RUN_INFO_KEY, ViTClassifier
from vit_mnist.utils import describe_device, exit_on_user_error, write_metrics

log = logging.getLogger(__name__)


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint of this project safely (``torch.load(weights_only=True)``), on CPU.

    Returns:
        The checkpoint dict, with ``hyper_parameters`` (the model's arguments) and the
        run info (data config, precision, seed) that ``train`` stored.

    Raises:
        CheckpointError: the file is missing, unreadable or truncated, or is not a
            checkpoint written by vit_mnist; the message names the path.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {path} does not exist; give ckpt_path=<run dir>/checkpoints/<file>.ckpt"
        )
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"checkpoint {path} cannot be read (truncated or not a checkpoint?): {first}"
        ) from e
    if (
        not isinstance(ckpt, dict)
        or "state_dict" not in ckpt
        or "model" not in ckpt.get("hyper_parameters", {})
    ):
        raise CheckpointError(
            f"{path} is not a vit_mnist checkpoint (no model arguments stored in it)"
        )
    return ckpt


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Test the checkpoint at ``cfg.ckpt_path`` and write ``metrics.json`` into the run dir.

    The model is rebuilt from the arguments stored in the checkpoint; the dataset is the
    one the checkpoint was trained on unless ``cfg.data`` is given. The precision is the
    one used in training, so the test accuracy matches the training run's.

    Returns:
        ``test/acc`` (fraction in [0, 1]), ``test/loss``, ``ckpt_path``, ``device`` and
        ``dataset``.

    Raises:
        CheckpointError: see :func:`read_checkpoint`.
    """
    if OmegaConf.is_missing(cfg, "ckpt_path") or not cfg.ckpt_path:
        raise CheckpointError(
            "ckpt_path is required: python eval.py "
            "ckpt_path=outputs/train/runs/<run>/checkpoints/<best-...>.ckpt"
        )
    ckpt_path = Path(cfg.ckpt_path)
    ckpt = read_checkpoint(ckpt_path)
    run_info = ckpt.get(RUN_INFO_KEY, {})
    L.seed_everything(cfg.seed, workers=True)

    if cfg.get("data") is not None:
        data_cfg = cfg.data
    elif "data" in run_info:
        data_cfg = OmegaConf.create(run_info["data"])
        if "data_dir" in data_cfg:
            # The training machine's path may not exist here: use this run's data folder.
            data_cfg.data_dir = cfg.paths.data_dir
    else:
        raise CheckpointError(f"{ckpt_path} stores no data config; pass data=mnist (or another)")
    datamodule: L.LightningDataModule = hydra.utils.instantiate(data_cfg)

    module = ViTClassifier.load_from_checkpoint(ckpt_path, map_location="cpu", weights_only=True)
    # The training precision, unless `precision=` says otherwise: bf16 and fp32 logits can
    # differ in the last bits, and the accuracy should match the training run's.
    precision = cfg.get("precision") or run_info.get("precision") or cfg.trainer.precision
    loggers = [hydra.utils.instantiate(c) for c in (cfg.get("logger") or {}).values()]
    trainer: L.Trainer = hydra.utils.instantiate(cfg.trainer, logger=loggers, precision=precision)
    results = trainer.test(module, datamodule=datamodule)[0]

    metrics = {
        **results,
        "ckpt_path": str(ckpt_path.resolve()),
        "device": describe_device(trainer.strategy.root_device),
        "precision": str(trainer.precision),
        "dataset": getattr(datamodule, "name", type(datamodule).__name__),
        "data_source": getattr(datamodule, "source", None),
    }
    print(f"test/acc = {results['test/acc']:.4f}  (test/loss = {results['test/loss']:.4f})")
    return write_metrics(Path(cfg.paths.output_dir) / "metrics.json", metrics)


@exit_on_user_error
def main(cfg: DictConfig) -> dict[str, Any]:
    """The body of ``python eval.py``: ``evaluate(cfg)``, bad input reported in one line."""
    return evaluate(cfg)
