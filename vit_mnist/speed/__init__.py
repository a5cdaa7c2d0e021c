"""The speed layer: named ways to run the reference model's training step
(:data:`~vit_mnist.speed.choose.PATHS`) on its own parameters, each tested against it
(tests/test_speed.py), chosen by measurement on the user's machine; ``train()`` makes one
call, :func:`~vit_mnist.speed.choose.prepare_speed`. docs/speed.md: where each path wins."""

import os
from pathlib import Path


def cache_root() -> Path:
    """Where the speed layer keeps the kernels it builds: ``$VIT_MNIST_CACHE``, else
    ``$XDG_CACHE_HOME/vit_mnist``, else ``~/.cache/vit_mnist``."""
    if root := os.environ.get("VIT_MNIST_CACHE"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vit_mnist"
