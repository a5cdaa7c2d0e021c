"""vit-mnist: Vision Transformers on MNIST with a hand-written multi-head self-attention."""

import os

from omegaconf import OmegaConf

# configs/paths/default.yaml: `root_dir: ${vit_mnist.cwd:}`, the folder the command started in.
# Hydra's ${hydra:runtime.cwd} says the same but cannot be resolved while a multirun names
# its sweep dir (outputs/<task>/multiruns/...), before any job has started.
OmegaConf.register_new_resolver("vit_mnist.cwd", os.getcwd, replace=True)


def _auto_precision(accelerator: str = "auto") -> str:
    from vit_mnist.utils import resolve_precision, uses_cuda

    return resolve_precision("auto", uses_cuda(str(accelerator)))


# configs/trainer/default.yaml: `precision: ${vit_mnist.auto_precision:${.accelerator}}`,
# bf16-mixed where the hardware has bfloat16, else 32-true (a value Lightning accepts, so the
# trainer config can be instantiated as it is).
OmegaConf.register_new_resolver("vit_mnist.auto_precision", _auto_precision, replace=True)
