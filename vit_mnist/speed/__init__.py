"""The speed layer: faster ways to run the reference model's training step.

The model a student reads is :mod:`vit_mnist.models`; nothing here changes what it
computes. Each way of running its training step is a named path
(:data:`~vit_mnist.speed.choose.PATHS`) that runs the model's own parameters and is tested
against the reference (tests/test_speed.py). Which is fastest depends on the machine, so
``speed.path=auto`` measures them on the user's own; ``train()`` makes one call,
:func:`~vit_mnist.speed.choose.prepare_speed`. docs/speed.md has where each path wins.
"""

import os
from pathlib import Path

# The paths' names, as ``speed.path`` takes them (with ``auto``): the settings schema's
# choices, and the keys of :data:`~vit_mnist.speed.choose.PATHS`.
PATH_NAMES = ("reference", "fused", "handwritten", "compile", "native")


def cache_root() -> Path:
    """Where the speed layer keeps what it measured and built: ``$VIT_MNIST_CACHE``, else
    ``$XDG_CACHE_HOME/vit_mnist``, else ``~/.cache/vit_mnist``."""
    root = os.environ.get("VIT_MNIST_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vit_mnist"
