"""The learning-rate schedule of the training recipe."""

from __future__ import annotations

import math


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
