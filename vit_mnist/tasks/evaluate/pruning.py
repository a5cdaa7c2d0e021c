"""``eval.py analysis=prune``: which heads can go, by each measure of a head, and the pruned
model the user asked for (:mod:`vit_mnist.analysis.pruning`).

It runs in two phases so that the test set decides nothing: :func:`plan_pruning` reads the
validation split only, before the checkpoint is tested, and chooses the order and the
step (``prune.max_drop``); :func:`report_pruning` then scores every step on the test
split, writes the chosen model, its speed and size, and fine-tunes it when asked.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from vit_mnist.analysis.components import head_counts
from vit_mnist.analysis.per_class import accuracy_and_loss, predict
from vit_mnist.analysis.pruning import (
    MeasureData,
    Step,
    best_choice,
    choose_step,
    mean_accuracy,
    measure_data,
    prune_heads,
    prune_in_order,
    pruning_figure,
    pruning_plan,
    speed_and_size,
)
from vit_mnist.console import progress
from vit_mnist.errors import ConfigError
from vit_mnist.io import write_csv
from vit_mnist.training.checkpointing import AtomicCheckpointIO
from vit_mnist.training.module import RUN_INFO_KEY, ViTClassifier

log = logging.getLogger(__name__)


@dataclass
class PruningPlan:
    """What the validation split decided: each order's steps and the chosen (order, step)."""

    curves: dict[str, list[Step]]
    picks: dict[str, int]  # per order, its most-pruned step within max_drop
    chosen: tuple[str, int]
    total: int
    per_step: int
    settings: dict[str, Any]
    finetune_config: Path | None

    @property
    def step(self) -> Step:
        """The chosen step."""
        order, index = self.chosen
        return self.curves[order][index]

    @property
    def unpruned(self) -> Step:
        """Step 0: the unpruned model."""
        return self.curves[self.chosen[0]][0]


def check_prune_keys(cfg: DictConfig) -> None:
    """Refuse a ``prune.*`` key typed on the command line that would not be applied: any
    without ``analysis=prune``, and the fine-tune's own without ``prune.finetune_epochs``.

    Raises:
        ConfigError: naming the override as typed and the fix.
    """
    if not HydraConfig.initialized():  # a test or a notebook: nothing was typed
        return
    typed = {o.lstrip("+").partition("=")[0]: o for o in HydraConfig.get().overrides.task}
    prune = [o for key, o in sorted(typed.items()) if key.startswith("prune.")]
    if prune and cfg.get("analysis") != "prune":
        raise ConfigError(
            f"{prune[0]} applies to analysis=prune only: add analysis=prune, or drop it"
        )
    tuning = [
        o for o in prune if o.lstrip("+").startswith(("prune.finetune_lr", "prune.finetune_w"))
    ]
    if tuning and not cfg.prune.finetune_epochs:
        raise ConfigError(
            f"{tuning[0]} applies to the fine-tune, which prune.finetune_epochs=0 leaves out: "
            "add prune.finetune_epochs=2, or drop it"
        )


def finetune_config(ckpt_path: Path) -> Path:
    """The training run's own config folder (``<run>/.hydra``, beside ``checkpoints/``),
    which the fine-tune starts from so that it trains with the run's own recipe and data.

    Raises:
        ConfigError: the checkpoint is not in a run dir that has one.
    """
    folder = ckpt_path.resolve().parent.parent / ".hydra"
    if not (folder / "config.yaml").is_file():
        raise ConfigError(
            f"prune.finetune_epochs needs the training run's config, {folder}/config.yaml, "
            f"which is not there for {ckpt_path}: drop prune.finetune_epochs, then fine-tune "
            "the pruned checkpoint with python train.py init_from=<it> trainer.max_epochs=2 "
            "module.lr=1e-3 module.warmup_epochs=0.5"
        )
    return folder


def _classifier(module: ViTClassifier, net, args: dict[str, Any]) -> ViTClassifier:
    """A module like ``module`` (its hyper-parameters and run info) around ``net``."""
    pruned = ViTClassifier(**{**dict(module.hparams), "model": args})
    pruned.net.load_state_dict(net.state_dict())
    pruned.run_info = dict(module.run_info)
    return pruned


def _measure_data(trainer: L.Trainer, module: ViTClassifier, loader, s: dict) -> MeasureData:
    """What the measures read: the validation images, with the unpruned model's logits."""
    images = torch.cat([batch[0] for batch in loader])
    logits, labels = predict(trainer, module, loader)
    return measure_data(
        images[: len(labels)], labels, logits,
        num_images=int(s["num_images"]), seed=int(s["seed"]), normalise=bool(s["normalise"]),
    )  # fmt: skip


def plan_pruning(
    trainer: L.Trainer, module: ViTClassifier, datamodule, given, ckpt_path: Path, *, bar=True
) -> PruningPlan:
    """Prune by every order of ``prune.orders`` on the validation split and choose the
    most-pruned step within ``prune.max_drop`` validation points, of the order that
    removes the most heads there (:func:`~vit_mnist.analysis.pruning.best_choice`).

    Args:
        given: the ``prune`` section of the eval config (configs/eval.yaml).

    Raises:
        ConfigError: ``prune.finetune_epochs`` for a checkpoint outside its run dir, or a
            checkpoint pruned already.
    """
    s = OmegaConf.to_container(given) if isinstance(given, DictConfig) else dict(given)
    config = finetune_config(ckpt_path) if s["finetune_epochs"] else None
    net, args = module.net, dict(module.hparams["model"])
    counts = head_counts(net)
    if len(set(counts)) > 1 or "pruned_from" in module.run_info:
        raise ConfigError(
            f"analysis=prune needs an unpruned model; {ckpt_path} is pruned already (heads "
            f"per block {counts}): prune the checkpoint it came from"
        )
    depth, heads = net.depth, counts[0]
    total = depth * heads
    per_step, target = pruning_plan(total, depth, s["step_fraction"], s["max_fraction"])
    datamodule.prepare_data()  # the test loop has not run yet to do it
    datamodule.setup("validate")
    loader = datamodule.val_dataloader()
    data = _measure_data(trainer, module, loader, s)

    def score(pruned, pruned_args) -> tuple[float, float]:
        return accuracy_and_loss(trainer, _classifier(module, pruned, pruned_args), loader)

    steps = len(s["orders"]) * (math.ceil(target / per_step) + 1)
    curves, picks = {}, {}
    with progress(steps, "pruning (validation)", enabled=bar) as shown:
        for order in s["orders"]:
            start = time.perf_counter()
            curves[order] = prune_in_order(
                net, args, order, data, score, per_step=per_step, target=target,
                progress=shown.update,
            )  # fmt: skip
            picks[order] = choose_step([step.val_acc for step in curves[order]], s["max_drop"])
            removed = len(curves[order][picks[order]].removed)
            log.info(
                "pruning by %s: %d of %d heads removed within %s val points (%.0f s)",
                order, removed, total, s["max_drop"], time.perf_counter() - start,
            )  # fmt: skip
    chosen = best_choice(curves, float(s["max_drop"]))
    return PruningPlan(curves, picks, chosen, total, per_step, s, config)


def _test_scores(trainer: L.Trainer, module: ViTClassifier, loader, plan: PruningPlan, bar: bool):
    """Each step's test accuracy and loss, in place; a set of heads two orders share is
    scored once."""
    args, seen = dict(module.hparams["model"]), {}
    steps = [s for curve in plan.curves.values() for s in curve]
    with progress(len(steps), "pruning (test)", enabled=bar) as shown:
        for step in steps:
            key = frozenset(step.removed)
            if key not in seen:
                net, pruned_args = prune_heads(module.net, args, step.removed)
                seen[key] = accuracy_and_loss(
                    trainer, _classifier(module, net, pruned_args), loader
                )
            step.test_acc, step.test_loss = seen[key]
            shown.update()


def _save(path: Path, ckpt: dict[str, Any], pruned: ViTClassifier, step: Step) -> None:
    """``pruned``'s checkpoint, written whole: Lightning's own keys and the run info of the
    unpruned ``ckpt``, the pruned weights and model arguments, the heads removed (numbered
    as in the unpruned model) and what it was pruned from; no optimizer, scheduler or loop
    state, which belong to the unpruned model's training."""
    lightning = ("epoch", "global_step", "pytorch-lightning_version")
    saved = {
        **{k: ckpt[k] for k in lightning if k in ckpt},
        "state_dict": pruned.state_dict(),
        "hparams_name": ckpt.get("hparams_name", "kwargs"),
        "hyper_parameters": {**ckpt["hyper_parameters"], "model": pruned.hparams["model"]},
        RUN_INFO_KEY: {
            **ckpt.get(RUN_INFO_KEY, {}),
            # Read by predict.py (its speed beside the unpruned model's) through run_info.
            "pruned_from": {
                "model": ckpt["hyper_parameters"]["model"],
                "order": step.order,
                "val_acc": step.val_acc,
                "test_acc": step.test_acc,
            },
        },
        # The explorer reads the heads removed from here.
        "pruned_heads": [f"{layer}:{head}" for layer, head in step.removed],
    }
    AtomicCheckpointIO().save_checkpoint(saved, path)


def _file_name(plan: PruningPlan, step: Step) -> str:
    kept = plan.total - len(step.removed)
    return f"pruned-{step.order}-keeps-{kept}-of-{plan.total}-heads-val-{100 * step.val_acc:.2f}"


def _finetune(plan: PruningPlan, pruned_ckpt: Path, out: Path) -> dict[str, Any]:
    """``train.py init_from=<pruned_ckpt>`` for ``finetune_epochs`` epochs, with the
    training run's own config (recipe and data) at ``finetune_lr`` after
    ``finetune_warmup_epochs`` of warm-up, in ``out/finetune``, as its own process
    (a task does not run another in-process); returns its metrics.json, or the exit status
    of a run that failed (the pruned checkpoint is written already)."""
    epochs = int(plan.settings["finetune_epochs"])
    command = [
        sys.executable, "-c", "from vit_mnist.cli import train; train()",
        "--config-path", str(plan.finetune_config), "--config-name", "config",
        f"++init_from={pruned_ckpt}", "++ckpt_path=null", f"++trainer.max_epochs={epochs}",
        "++module.schedule_epochs=null", f"++module.lr={plan.settings['finetune_lr']}",
        f"++module.warmup_epochs={plan.settings['finetune_warmup_epochs']}",
        f"hydra.run.dir={out / 'finetune'}",
    ]  # fmt: skip
    log.info("fine-tuning the pruned model for %d epoch(s): %s", epochs, " ".join(command[3:]))
    code = subprocess.run(command, check=False).returncode
    metrics = out / "finetune" / "metrics.json"
    if code or not metrics.is_file():
        log.error("the fine-tune failed (exit status %d); see %s", code, out / "finetune")
        return {"exit_status": code}
    return json.loads(metrics.read_text())


def _summaries(plan: PruningPlan) -> dict[str, dict[str, Any]]:
    """Per order: the step ``max_drop`` picks on its curve and the mean accuracies (areas
    under the curves, :func:`~vit_mnist.analysis.pruning.mean_accuracy`)."""
    out = {}
    for order, steps in plan.curves.items():
        step = steps[plan.picks[order]]
        out[order] = {
            "heads_removed": len(step.removed),
            "val_acc": round(step.val_acc, 6),
            "test_acc": round(step.test_acc, 6),
            "removed": [f"{layer}:{head}" for layer, head in step.removed],
            "mean_val_acc": round(mean_accuracy(steps, "val_acc"), 6),
            "mean_test_acc": round(mean_accuracy(steps, "test_acc"), 6),
        }
    return out


def report_pruning(trainer: L.Trainer, run, ckpt: dict[str, Any], plan: PruningPlan, bar=True):
    """Score ``plan``'s steps on the test split and write ``pruning.csv`` (one row per order
    and step), ``pruning.png`` and TensorBoard curves, the chosen model as
    ``pruned-<order>-keeps-<k>-of-<n>-heads-val-<acc>.ckpt`` (with ``prune.save_steps``
    every step's, under ``pruned_steps/``), its speed and size beside the unpruned
    model's, and with ``prune.finetune_epochs`` its fine-tune.

    Returns:
        ``pruning/*`` metrics: ``ckpt``, ``order``, ``heads_kept``, ``val_acc``,
        ``test_acc`` of the chosen step, ``orders`` (per order: the heads it removes within
        ``max_drop``, and its mean validation and test accuracy), ``speed`` and, with a
        fine-tune, ``finetune`` (its test/acc, val/acc_best, best_ckpt).
    """
    module, out = run.module, run.out
    _test_scores(trainer, module, run.loader, plan, bar)
    write_csv(out / "pruning.csv", [s.row(plan.total) for c in plan.curves.values() for s in c])
    args = dict(module.hparams["model"])
    if plan.settings["save_steps"]:
        for step in (s for c in plan.curves.values() for s in c[1:]):
            net, pruned_args = prune_heads(module.net, args, step.removed)
            pruned = _classifier(module, net, pruned_args)
            _save(out / "pruned_steps" / f"{_file_name(plan, step)}.ckpt", ckpt, pruned, step)
    step = plan.step
    pruned = _classifier(module, *prune_heads(module.net, args, step.removed))
    path = out / f"{_file_name(plan, step)}.ckpt"
    _save(path, ckpt, pruned, step)
    for order, steps in plan.curves.items():
        for s in steps:
            values = {f"pruning/{order}/{k}": getattr(s, k) for k in ("val_acc", "test_acc")}
            run.scalars(values, step=len(s.removed))
    title = (
        f"head pruning by each measure: {plan.total} heads, {plan.per_step} per step, "
        f"re-scored on the validation split; kept: within {plan.settings['max_drop']} val points"
    )
    run.publish(pruning_figure(plan.curves, plan.total, plan.chosen, title), "pruning")
    metrics = {
        "pruning/ckpt": str(path.resolve()),
        "pruning/order": step.order,
        "pruning/heads_kept": plan.total - len(step.removed),
        "pruning/num_heads": pruned.hparams["model"]["num_heads"],
        "pruning/val_acc": step.val_acc,
        "pruning/test_acc": step.test_acc,
        "pruning/orders": _summaries(plan),
        "pruning/speed": speed_and_size(pruned.net, module.net, run.images[:256]),
    }
    _print(plan, metrics, path)
    if plan.finetune_config is not None:
        tuned = _finetune(plan, path, out)
        keys = ("test/acc", "test/acc_one_view", "val/acc_best", "best_ckpt", "exit_status")
        metrics["pruning/finetune"] = {k: tuned[k] for k in keys if k in tuned}
        if "test/acc" in tuned:
            print(
                f"fine-tuned {plan.settings['finetune_epochs']} epoch(s): test "
                f"{100 * tuned['test/acc']:.2f}% (unpruned {100 * plan.unpruned.test_acc:.2f}%), "
                f"{tuned.get('best_ckpt')}"
            )
    return metrics


def _print(plan: PruningPlan, metrics: dict[str, Any], path: Path) -> None:
    """The terminal summary of :func:`report_pruning`."""
    drop = plan.settings["max_drop"]
    print(f"head pruning, {plan.total} heads: what each order removes within {drop} val points")
    print(f"{'order':>17} {'removed':>7} {'val acc':>8} {'test acc':>8} {'mean val':>8} mean test")
    for order, o in metrics["pruning/orders"].items():
        print(
            f"{order:>17} {o['heads_removed']:>7} {100 * o['val_acc']:7.2f}% "
            f"{100 * o['test_acc']:7.2f}% {100 * o['mean_val_acc']:7.2f}% "
            f"{100 * o['mean_test_acc']:8.2f}%"
        )
    speed = metrics["pruning/speed"]
    # Logged, not only printed: the run's eval.log names the file kept and what it scores.
    log.info(
        "kept %s: %d of %d heads, val %.2f%%, test %.2f%% (unpruned %.2f%%)",
        path, metrics["pruning/heads_kept"], plan.total, 100 * metrics["pruning/val_acc"],
        100 * metrics["pruning/test_acc"], 100 * plan.unpruned.test_acc,
    )  # fmt: skip
    faster = (
        "faster"
        if speed["speedup"] > 1.05
        else "not faster: the heads are a small share of the work"
    )
    print(
        f"speed on {speed['device']}: {speed['images_per_s']['pruned']:,.0f} images/s pruned, "
        f"{speed['images_per_s']['unpruned']:,.0f} unpruned ({speed['speedup']:.2f}x, {faster}); "
        f"{speed['params']['pruned']:,} of {speed['params']['unpruned']:,} parameters"
    )
