"""vit-mnist: Vision Transformers on MNIST with a hand-written multi-head self-attention."""

import importlib
import importlib.abc
import importlib.resources
import importlib.util
import os
import sys

from omegaconf import OmegaConf

# configs/paths/default.yaml: `root_dir: ${vit_mnist.cwd:}`, the folder the command started in.
# Hydra's ${hydra:runtime.cwd} says the same but cannot be resolved while a multirun names
# its sweep dir (outputs/<task>/multiruns/...), before any job has started.
OmegaConf.register_new_resolver("vit_mnist.cwd", os.getcwd, replace=True)


def _groups(*names: str) -> str:
    """``${vit_mnist.groups:data,trainer}``: each named config group of ``configs/`` with its
    options (the YAML files in its folder), a line each: a command's ``--help`` lists the
    groups it reads (configs/<command>.yaml, ``hydra.help``), the options from one place."""
    configs = importlib.resources.files("vit_mnist.configs")
    lines = []
    for name in names:
        files = configs.joinpath(name).iterdir()
        options = sorted(f.name[: -len(".yaml")] for f in files if f.name.endswith(".yaml"))
        lines.append(f"  {name}: {', '.join(options)}")
    return "\n".join(lines)


OmegaConf.register_new_resolver("vit_mnist.groups", _groups, replace=True)

# `logger=mlflow` keeps everything on the machine: MLflow's client would otherwise send
# usage reports to its makers. A user who sets the variable decides for themselves.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

# Modules that moved into the tasks/ and training/ rooms (2026-12-05). Run dirs written
# before name the old paths in their .hydra/config.yaml (`_target_: vit_mnist.module.
# ViTClassifier`), and so may a user's own configs and scripts: each old name is the module
# at its new place (the same module object, so its classes are the same classes).
MOVED = {
    "vit_mnist.train": "vit_mnist.tasks.train",
    "vit_mnist.evaluate": "vit_mnist.tasks.evaluate",
    "vit_mnist.predict": "vit_mnist.tasks.predict",
    "vit_mnist.export": "vit_mnist.tasks.export",
    "vit_mnist.explorer": "vit_mnist.tasks.explore",
    "vit_mnist.module": "vit_mnist.training.module",
    "vit_mnist.schedule": "vit_mnist.training.schedule",
    "vit_mnist.distillation": "vit_mnist.training.distillation",
    "vit_mnist.checkpointing": "vit_mnist.training.checkpointing",
    "vit_mnist.callbacks": "vit_mnist.training.callbacks",
    "vit_mnist.drawing": "vit_mnist.analysis.drawing",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a name of :data:`MOVED` (or a module inside a moved package) as the module
    at its new place."""

    @staticmethod
    def new_name(name: str) -> str | None:
        for old, new in MOVED.items():
            if name == old or name.startswith(old + "."):
                return new + name[len(old) :]
        return None

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001 - the finder protocol
        new = self.new_name(name)
        # A name that is no module at its new place either (a class in a _target_, such as
        # vit_mnist.callbacks.AttentionMapLogger) is not found under its old name.
        if new is None or importlib.util.find_spec(new) is None:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):  # noqa: ANN001
        return importlib.import_module(self.new_name(spec.name))

    def exec_module(self, module) -> None:  # noqa: ANN001 - run already, under its new name
        pass


sys.meta_path.insert(0, _MovedModules())
