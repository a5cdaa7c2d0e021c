"""Command-line entry points: ``python train.py`` and the console script ``vit-mnist-train``
are the same function, and so on for eval, predict and export.

The configs are read from the package ``vit_mnist.configs``, which is the top-level
``configs/`` folder of a source checkout (see ``[tool.setuptools.package-dir]`` in
pyproject.toml), so an installed wheel finds them too. Run dirs, data and checkpoints
go under the current directory (``paths.root_dir``), exactly as with ``python train.py``.
"""

from __future__ import annotations

from typing import Any

import hydra
from omegaconf import DictConfig

CONFIG_PATH = "pkg://vit_mnist.configs"


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="train")
def train(cfg: DictConfig) -> dict[str, Any]:
    """``vit-mnist-train [overrides]`` = ``python train.py [overrides]``."""
    import vit_mnist.train
    from vit_mnist.console import quiet_console

    quiet_console()
    return vit_mnist.train.main(cfg)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="eval")
def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """``vit-mnist-eval ckpt_path=PATH`` = ``python eval.py ckpt_path=PATH``."""
    import vit_mnist.evaluate
    from vit_mnist.console import quiet_console

    quiet_console()
    return vit_mnist.evaluate.main(cfg)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="predict")
def predict(cfg: DictConfig) -> Any:
    """``vit-mnist-predict ckpt_path=PATH images=[a.png]`` = ``python scripts/predict.py ...``."""
    import vit_mnist.predict
    from vit_mnist.console import quiet_console

    quiet_console()
    return vit_mnist.predict.main(cfg)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="export")
def export(cfg: DictConfig) -> Any:
    """``vit-mnist-export ckpt_path=PATH format=onnx`` = ``python scripts/export.py ...``."""
    import vit_mnist.export
    from vit_mnist.console import quiet_console

    quiet_console()
    return vit_mnist.export.main(cfg)
