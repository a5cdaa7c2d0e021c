"""The optimiser and learning-rate schedule of the training recipe."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning-rate multiplier: linear warm-up from 0, then cosine decay to ``min_lr_ratio``.

    Loshchilov and Hutter 2017 (SGDR) eq. 5 without restarts, after Goyal et al. 2017's
    linear warm-up.

    Args:
        step: optimizer steps taken so far (0-based).
        warmup_steps: steps of the linear ramp; the multiplier reaches 1 at this step.
        total_steps: steps in the whole run; the multiplier reaches ``min_lr_ratio`` here.
        min_lr_ratio: final learning rate as a fraction of the peak.

    Returns:
        A multiplier in [0, 1] for the peak learning rate.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def adamw_warmup_cosine(
    net: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] | list[float],
    warmup_epochs: float,
    min_lr_ratio: float,
    schedule_epochs: float | None,
    total_steps: int,
    max_epochs: int | None,
) -> dict[str, Any]:
    """AdamW (Loshchilov and Hutter 2019) over ``net``'s trainable parameters with the
    :func:`warmup_cosine` schedule stepped per batch, as Lightning's
    ``configure_optimizers`` returns them.

    Args:
        lr: peak learning rate; weight_decay: of the weight matrices only; betas: AdamW's.
        warmup_epochs: epochs of the linear ramp; min_lr_ratio: see :func:`warmup_cosine`.
        schedule_epochs: epochs the schedule spans (None: ``max_epochs``); more than
            ``max_epochs`` makes the run the first part of a longer one.
        total_steps: optimiser steps of the whole run (the trainer's estimate).
        max_epochs: the trainer's epochs, to turn epochs into steps.
    """
    # Weight matrices are decayed; biases, LayerNorm gains and the embeddings
    # (cls_token, pos_embed) are not, as in Dosovitskiy et al. and timm.
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    matrices = {n for n, p in named if p.ndim >= 2 and n not in ("cls_token", "pos_embed")}
    decay = [p for n, p in named if n in matrices]
    no_decay = [p for n, p in named if n not in matrices]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr,
        betas=tuple(betas),
        # One kernel per parameter instead of a Python loop of tensor ops: the update
        # of 0.2M parameters took 2.1 ms on one CPU thread, fused 0.4 ms (of a 40 ms step).
        fused=all(p.device.type in ("cpu", "cuda") for p in decay + no_decay),
    )
    total_steps = max(1, total_steps)
    steps_per_epoch = total_steps / max(1, max_epochs or 1)
    if schedule_epochs is not None:
        total_steps = max(1, round(schedule_epochs * steps_per_epoch))
    warmup_steps = min(total_steps, max(1, round(warmup_epochs * steps_per_epoch)))
    schedule = dict(warmup_steps=warmup_steps, total_steps=total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, **schedule, min_lr_ratio=min_lr_ratio)
    )
    return dict(optimizer=optimizer, lr_scheduler={"scheduler": scheduler, "interval": "step"})
