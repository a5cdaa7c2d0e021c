"""The model in eval mode for an analysis, and back in the mode it was in afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``with evaluating(model):`` runs the block with ``model`` in eval mode (dropout and
    drop-path off, as the analyses are defined) and restores the mode it had, also when the
    block raises: an analysis called during training leaves the model training."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
