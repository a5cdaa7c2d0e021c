"""``train(cfg)``: config -> datamodule + model -> Lightning trainer -> checkpoints and metrics."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from vit_mnist.callbacks.throughput import TrainThroughput
from vit_mnist.errors import ConfigError
from vit_mnist.models.vit import check_vit_args
from vit_mnist.module import ViTClassifier
from vit_mnist.utils import describe_device, exit_on_user_error, write_metrics

log = logging.getLogger(__name__)


def _resolved(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if node is not None else None


def check_config(cfg: DictConfig) -> None:
    """Fail fast, before any data is read, on settings that cannot work.

    Raises:
        ConfigError: naming the key, the value and what would be valid.
    """
    check_vit_args(**_resolved(cfg.model))
    batch_size = cfg.data.get("batch_size")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size <= 0):
        raise ConfigError(f"data.batch_size={batch_size!r} must be a positive integer")
    max_epochs = cfg.trainer.get("max_epochs")
    if max_epochs is not None and max_epochs <= 0:
        raise ConfigError(f"trainer.max_epochs={max_epochs} must be positive")
    accelerator = str(cfg.trainer.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.accelerator={accelerator} but this machine has no CUDA device; "
            "use trainer=cpu or trainer=default (accelerator: auto)"
        )


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train, then test the best checkpoint; write ``metrics.json`` into the run dir.

    Args:
        cfg: the composed ``configs/train.yaml``.

    Returns:
        The metrics written to ``<paths.output_dir>/metrics.json``: ``test/acc``,
        ``test/loss``, ``val/acc_best`` (fractions), ``num_params``, ``train_time_s``
        (wall seconds of ``trainer.fit``), ``device``, ``data_source`` and more.

    Raises:
        ConfigError: an impossible setting (checked before data or model are built).
        DataError: data files that cannot be found, fetched or verified.
    """
    check_config(cfg)
    L.seed_everything(cfg.seed, workers=True)
    output_dir = Path(cfg.paths.output_dir)

    log.info("Building datamodule <%s>", cfg.data._target_)
    datamodule: L.LightningDataModule = hydra.utils.instantiate(cfg.data)
    log.info("Building model: %s", _resolved(cfg.model))
    # _convert_="all": plain dicts and lists, so checkpoints load with weights_only=True.
    module: ViTClassifier = hydra.utils.instantiate(
        cfg.module, model=_resolved(cfg.model), _convert_="all"
    )
    module.run_info = {
        "data": _resolved(cfg.data),
        "precision": str(cfg.trainer.get("precision", "32-true")),
        "seed": cfg.seed,
    }
    throughput = TrainThroughput()
    callbacks = [hydra.utils.instantiate(c) for c in (cfg.get("callbacks") or {}).values()]
    callbacks.append(throughput)
    loggers = [hydra.utils.instantiate(c) for c in (cfg.get("logger") or {}).values()]
    trainer: L.Trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers)

    num_params = sum(p.numel() for p in module.net.parameters())
    for lg in trainer.loggers:
        lg.log_hyperparams(
            {"num_params": num_params, "seed": cfg.seed, "batch_size": cfg.data.batch_size}
        )

    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"))
    train_time_s = time.perf_counter() - start
    fit_metrics = {
        k: v for k, v in trainer.callback_metrics.items() if k.startswith(("train/", "val/"))
    }

    test_metrics: dict[str, Any] = {}
    best_ckpt = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    if cfg.get("test"):
        # The best checkpoint by val/acc; the current weights when no checkpoint was kept.
        trainer.test(module, datamodule=datamodule, ckpt_path=best_ckpt or None)
        test_metrics = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("test/")}

    metrics = {
        **fit_metrics,
        **test_metrics,
        "num_params": num_params,
        "train_time_s": round(train_time_s, 2),
        # Median over epochs of the training loop alone (no validation, no map logging).
        "train_images_per_s": round(throughput.median, 1) if throughput.median else None,
        "epochs": trainer.current_epoch,
        "global_steps": trainer.global_step,
        "device": describe_device(trainer.strategy.root_device),
        "precision": str(trainer.precision),
        "dataset": getattr(datamodule, "name", type(datamodule).__name__),
        "data_source": getattr(datamodule, "source", None),
        "best_ckpt": best_ckpt or None,
        "seed": cfg.seed,
    }
    return write_metrics(output_dir / "metrics.json", metrics)


@exit_on_user_error
def main(cfg: DictConfig) -> dict[str, Any]:
    """The body of ``python train.py``: ``train(cfg)``, bad input reported in one line."""
    return train(cfg)
