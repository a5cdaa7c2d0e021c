"""``evaluate(cfg)``: rebuild a model from its checkpoint alone, test it, and report per
class and with the analysis asked for (:mod:`vit_mnist.tasks.evaluate.analyses`)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from omegaconf import DictConfig

from vit_mnist.analysis.distillation import cls_dist_similarity
from vit_mnist.analysis.per_class import (
    class_report,
    confusion_matrix_figure,
    misclassified_grid,
    misclassified_relevance_grid,
    predict,
)
from vit_mnist.errors import CheckpointError, ConfigError, exit_on_user_error
from vit_mnist.hardware import describe_device, resolve_accelerator, resolve_precision
from vit_mnist.io import write_csv, write_metrics
from vit_mnist.models.vit import VisionTransformer
from vit_mnist.settings import EvalSettings, check_settings
from vit_mnist.tasks.evaluate.analyses import (
    EvalRun,
    analyse_circuits,
    analyse_faithfulness,
    analyse_heads,
    analyse_roles,
    check_class_pairs,
    circuit_pairs,
)
from vit_mnist.tasks.evaluate.pruning import check_prune_keys, plan_pruning, report_pruning
from vit_mnist.training.checkpointing import (
    checkpoint_datamodule,
    read_checkpoint,
    resolve_ckpt_path,
)
from vit_mnist.training.module import RUN_INFO_KEY, ViTClassifier

log = logging.getLogger(__name__)


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Test the checkpoint at ``cfg.ckpt_path`` and write the evaluation into the run dir.

    The model is rebuilt from the arguments stored in the checkpoint; the dataset is the
    one the checkpoint was trained on unless ``cfg.data`` is given. The precision is the
    one used in training, so the test accuracy matches the training run's. Loaded on the
    CPU first, so a checkpoint trained on a GPU evaluates anywhere.

    ``split=val`` computes the same report on the validation images the training run held
    out (its keys then start with ``val/``), so that an evaluation setting such as
    ``test_time_shift`` can be chosen without looking at the test set.
    ``test_time_shift`` (pixels; null keeps the checkpoint's own) sets the test-time
    augmentation of :class:`~vit_mnist.training.module.ViTClassifier`.

    Writes ``metrics.json`` (overall and per-class metrics, the confusion matrix),
    ``per_class.csv``, ``confusion_matrix.png``, ``misclassified.png``,
    ``misclassified_relevance.png`` (class relevance of the true and the predicted class
    for the first 16 errors; not written when there are none) and TensorBoard events;
    with ``analysis=heads`` also ``head_importance.csv`` (ablation and gradient head
    importance) and ``head_importance.png``; with ``analysis=faithfulness``
    ``faithfulness.csv`` and ``faithfulness.png`` (the perturbation test); with
    ``analysis=prune`` ``pruning.csv``, ``pruning.png`` and the pruned checkpoint (head
    pruning by each measure, chosen on the validation split before the test set is read;
    see :mod:`vit_mnist.tasks.evaluate.pruning`).

    Returns:
        The metrics written to ``metrics.json``: ``test/acc`` (fraction in [0, 1]),
        ``test/loss``, ``per_class``, ``confusion_matrix``, ``num_misclassified``, ...

    Raises:
        CheckpointError: see :func:`read_checkpoint` and :func:`resolve_ckpt_path`.
        ConfigError: a setting that ``EvalSettings`` (vit_mnist/settings.py) refuses, or an
            analysis with ``split=val``.
    """
    check_settings(cfg, EvalSettings)
    check_prune_keys(cfg)
    analysis, split = cfg.get("analysis"), cfg.get("split", "test")
    # Each alone is checked by the schema (EvalSettings); together, the analyses but roles
    # and circuits need the test images (those two ask what heads do, which validation
    # images show as well).
    if split != "test" and analysis not in (None, "roles", "circuits"):
        raise ConfigError(
            f"analysis={analysis} runs on the test images; drop split={split} to run it"
        )
    ckpt_path = resolve_ckpt_path(cfg)
    ckpt = read_checkpoint(ckpt_path)
    run_info = ckpt.get(RUN_INFO_KEY, {})
    L.seed_everything(cfg.seed, workers=True)
    datamodule = checkpoint_datamodule(cfg, ckpt_path, run_info)
    if split == "val":
        # Lightning's test loop (its metrics, and the test step's test-time augmentation)
        # run on the held-out validation images instead of the test images.
        datamodule.test_dataloader = datamodule.val_dataloader
    module = _load_module(cfg, ckpt_path)
    trainer, quiet = _trainers(cfg, run_info)
    bar = bool(cfg.trainer.get("enable_progress_bar", True))
    if analysis == "prune":  # heads and step chosen on the validation split, before any test
        plan = plan_pruning(quiet(), module, datamodule, cfg.prune, ckpt_path, bar=bar)
    results = _test(trainer, module, datamodule, ckpt_path, split)
    run, metrics, cm = _report(cfg, trainer, module, datamodule, results, ckpt_path)
    if analysis == "prune":
        metrics.update(report_pruning(quiet(), run, ckpt, plan, bar))
    elif analysis:
        start = time.perf_counter()
        metrics.update(_analyse(cfg, quiet(), run, datamodule, cm, bar=bar))
        log.info("analysis=%s done (%.0f s)", analysis, time.perf_counter() - start)
    if run.writer is not None:
        run.writer.flush()  # the figures above, on disk before evaluate returns
    return write_metrics(run.out / "metrics.json", metrics)


def _analyse(cfg: DictConfig, trainer: L.Trainer, run, datamodule, cm, *, bar: bool) -> dict:
    """The metrics of ``cfg.analysis`` (heads, faithfulness, roles or circuits) on ``run``,
    with ``trainer`` for the passes that use one and progress bars when ``bar``; ``cm``:
    the confusion matrix (rows true, columns predicted) that picks the circuits' pairs."""
    analysis = cfg.analysis
    if analysis == "heads":
        return analyse_heads(trainer, run, bar=bar)
    if analysis == "faithfulness":
        settings = cfg.get("faithfulness") or {}
        num_images, seed = int(settings.get("num_images", 1000)), int(settings.get("seed", 0))
        fill = float(getattr(datamodule, "background", 0.0))
        return analyse_faithfulness(run, num_images, fill=fill, seed=seed, bar=bar)
    if analysis == "roles":
        pixels = run.images * getattr(datamodule, "std", 1.0) + getattr(datamodule, "mean", 0.0)
        return {"head_roles": analyse_roles(trainer, run, pixels, bar=bar)}
    pairs = circuit_pairs(cm, cfg.circuits)  # circuits
    return analyse_circuits(run, pairs, pair_images=int(cfg.circuits.pair_images), bar=bar)


def _load_module(cfg: DictConfig, ckpt_path: Path) -> ViTClassifier:
    """The checkpoint's module on the CPU, with ``cfg.test_time_shift`` when given.

    Raises:
        ConfigError: an analysis of a convnet, or ``circuits.pairs`` outside its classes.
    """
    shift, analysis = cfg.get("test_time_shift"), cfg.get("analysis")
    overrides = {} if shift is None else {"test_time_shift": shift}
    module = ViTClassifier.load_from_checkpoint(
        ckpt_path, map_location="cpu", weights_only=True, **overrides
    )
    if analysis and not isinstance(module.net, VisionTransformer):
        raise ConfigError(
            f"analysis={analysis} studies attention heads; {ckpt_path} is a convnet "
            "(model=cnn): leave analysis out"
        )
    if analysis == "circuits":
        check_class_pairs(cfg.circuits.pairs, module.net.head.out_features)
    return module


def _trainers(
    cfg: DictConfig, run_info: dict[str, Any]
) -> tuple[L.Trainer, Callable[[], L.Trainer]]:
    """The test's trainer, with the loggers, and a maker of quiet ones (no progress bars,
    no logger) for the many passes of heads, roles and prune: all on the same device, at
    the training precision unless ``precision=`` says otherwise (bf16 and fp32 logits can
    differ in the last bits, and the accuracy should match the training run's)."""
    accelerator = resolve_accelerator(str(cfg.trainer.accelerator))  # cuda or cpu
    on_cuda = accelerator == "cuda"
    precision = resolve_precision(
        cfg.get("precision") or run_info.get("precision") or cfg.trainer.precision, on_cuda
    )
    if not on_cuda and str(precision).startswith("16") and not cfg.get("precision"):
        # A checkpoint trained with float16 on a GPU: float16 is a GPU format, use float32.
        log.info("trained with precision=%s on a GPU; evaluating in 32-true on the CPU", precision)
        precision = "32-true"
    loggers = [hydra.utils.instantiate(c) for c in (cfg.get("logger") or {}).values()]
    # The reports, heads and pruning run trainer.predict: as many batches as the test loop;
    # every trainer on the same device (accelerator=auto could pick another, such as MPS).
    same = {"precision": precision, "accelerator": accelerator}
    same["limit_predict_batches"] = cfg.trainer.get("limit_test_batches", 1.0)
    trainer: L.Trainer = hydra.utils.instantiate(cfg.trainer, logger=loggers, **same)
    off = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    return trainer, lambda: hydra.utils.instantiate(cfg.trainer, **same, **off)


def _test(trainer, module, datamodule, ckpt_path: Path, split: str) -> dict[str, float]:
    """Lightning's test loop on ``split``: its metrics, keyed ``<split>/...``.

    Raises:
        CheckpointError: a loss or accuracy that is not finite.
    """
    results = trainer.test(module, datamodule=datamodule)[0]
    if not all(map(math.isfinite, results.values())):
        # Finite weights (read_checkpoint checks them) whose loss is not: damaged all the same.
        raise CheckpointError(
            f"checkpoint {ckpt_path} is damaged: its finite weights give {results}, which no "
            "trained model gives; use another checkpoint of the run"
        )
    return {k.replace("test/", f"{split}/", 1): v for k, v in results.items()}


def _report(cfg, trainer, module, datamodule, results, ckpt_path: Path):
    """The per-class report, the misclassified images and the confusion matrix, written
    and published; returns the :class:`EvalRun` the analyses read, the metrics and the
    confusion matrix (K, K) int64 (rows true, columns predicted)."""
    split, out = cfg.get("split", "test"), Path(cfg.paths.output_dir)
    loader = datamodule.test_dataloader()
    logits, labels = predict(trainer, module, loader)
    images = torch.cat([batch[0] for batch in loader])[: len(labels)]
    class_names = list(getattr(datamodule, "class_names", None) or map(str, range(logits.shape[1])))
    rows, cm = class_report(logits, labels, class_names)
    write_csv(out / "per_class.csv", rows)
    writer = next(
        (lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None
    )
    device = trainer.strategy.root_device
    run = EvalRun(module, loader, images, labels, class_names, device, out, writer)
    grid, num_tiles = misclassified_grid(images, logits, labels, class_names)
    run.publish(grid, "misclassified")
    relevance_grid, relevance_columns = (
        misclassified_relevance_grid(module.net, images, logits, labels, class_names)
        if isinstance(module.net, VisionTransformer)
        else (None, 0)
    )
    if relevance_grid is not None:
        run.publish(relevance_grid, "misclassified_relevance")
    scores = ("accuracy", "precision", "recall")
    run.scalars({f"{split}_per_class/{k}/{r['name']}": r[k] for r in rows for k in scores})
    dataset = getattr(datamodule, "name", type(datamodule).__name__)
    title = f"{dataset} {split} set, {ckpt_path.name}"
    run.publish(confusion_matrix_figure(cm, class_names, title), "confusion_matrix")
    metrics = {
        **results,
        "split": split,
        "test_time_shift": module.hparams.test_time_shift,
        f"num_{split}_images": len(labels),
        "num_misclassified": int((logits.argmax(1) != labels).sum()),
        "misclassified_tiles": num_tiles,
        "misclassified_relevance_columns": relevance_columns,
        "per_class": {r["name"]: {k: r[k] for k in ("support", *scores)} for r in rows},
        "confusion_matrix": cm.tolist(),
        "ckpt_path": str(ckpt_path.resolve()),
        "device": describe_device(device, trainer.world_size),
        "precision": str(trainer.precision),
        "dataset": dataset,
        "data_source": getattr(datamodule, "source", None),
    }
    if getattr(module.net, "dist_token", None) is not None:
        # DeiT (section 4): the two tokens' cosine similarity, at the input and per block.
        metrics["cls_dist_cosine_by_layer"] = cls_dist_similarity(module.net, images[:1000])
    acc, loss = results[f"{split}/acc"], results[f"{split}/loss"]
    print(f"{split}/acc = {acc:.4f}  ({split}/loss = {loss:.4f})")
    return run, metrics, cm


@exit_on_user_error
def main(cfg: DictConfig) -> dict[str, Any]:
    """The body of ``python eval.py``: ``evaluate(cfg)``, bad input reported in one line."""
    return evaluate(cfg)
