"""vit-mnist: Vision Transformers on MNIST with a hand-written multi-head self-attention."""

import os

from omegaconf import OmegaConf

# configs/paths/default.yaml: `root_dir: ${vit_mnist.cwd:}`, the folder the command started in.
# Hydra's ${hydra:runtime.cwd} says the same but cannot be resolved while a multirun names
# its sweep dir (outputs/<task>/multiruns/...), before any job has started.
OmegaConf.register_new_resolver("vit_mnist.cwd", os.getcwd, replace=True)

# `logger=mlflow` keeps everything on the machine: MLflow's client would otherwise send
# usage reports to its makers. A user who sets the variable decides for themselves.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
