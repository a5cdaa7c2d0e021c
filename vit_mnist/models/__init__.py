"""The attention, the Vision Transformer and the convnet teacher, as plain ``nn.Module`` s."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from vit_mnist.errors import ConfigError
from vit_mnist.models.attention import MultiHeadSelfAttention
from vit_mnist.models.checks import check_vit_args
from vit_mnist.models.cnn import ConvNet, check_cnn_args
from vit_mnist.models.stem import PatchEmbedding
from vit_mnist.models.vit import EncoderBlock, VisionTransformer
from vit_mnist.settings import MODEL_CLASSES, ModelSettings, check_arguments, import_target

__all__ = [
    "ConvNet",
    "EncoderBlock",
    "MultiHeadSelfAttention",
    "PatchEmbedding",
    "VisionTransformer",
    "build_model",
    "check_model_args",
]


def _split(model: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    # No arch: a checkpoint of an earlier version, a ViT. A "compile" key, which such
    # checkpoints may carry, is the speed layer's (speed.path=compile) and ignored here.
    args = {k: v for k, v in model.items() if k not in ("arch", "compile")}
    return model.get("arch", "vit"), args


def check_model_args(model: dict[str, Any]) -> None:
    """Check a ``model`` config (or a checkpoint's model arguments) without building it;
    a key it leaves out takes the constructor's default.

    Raises:
        ConfigError: a value the settings schema refuses (``ModelSettings``), named as
            ``model.<key>``, or a combination (:func:`check_vit_args`,
            :func:`check_cnn_args`).
            A key the constructor of ``arch`` does not take (``+model.stem=conv`` with
            ``model=cnn``: the schema's model section is the union of both networks').
    """
    arch, args = _split(model)
    check_arguments(ModelSettings, {**args, "arch": arch}, prefix="model.")
    cnn = arch == "cnn"
    signature = inspect.signature(import_target(MODEL_CLASSES[arch]))
    foreign = [k for k in args if k not in signature.parameters]
    if foreign:
        shown = ", ".join(f"model.{k}" for k in foreign)
        kind = "the convnet (model=cnn)" if cnn else "the Vision Transformer"
        raise ConfigError(
            f"{shown}: not a setting of {kind}, which would not use it; drop it "
            f"({', '.join(f'~model.{k}' for k in foreign)} where the config sets it)"
        )
    bound = signature.bind(**args)
    bound.apply_defaults()
    (check_cnn_args if cnn else check_vit_args)(**bound.arguments)


def build_model(model: dict[str, Any]) -> nn.Module:
    """The network a ``model`` config describes: ``arch`` ``vit`` (the default) a
    :class:`VisionTransformer`, ``cnn`` a :class:`ConvNet`.

    Raises:
        ConfigError: see :func:`check_model_args`.
    """
    arch, args = _split(model)
    return import_target(MODEL_CLASSES[arch])(**args)
