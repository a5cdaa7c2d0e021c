"""Export a trained checkpoint to ONNX, a ``torch.export`` program or TorchScript, and check
it against PyTorch.

``python scripts/export.py ckpt_path=PATH format=onnx`` (or ``vit-mnist-export``) writes
a model that takes ``(batch, 1, 28, 28)`` float32 pixel values in [0, 1] (white digit on
black, as torchvision's ``ToTensor`` gives for MNIST) and returns ``(batch, num_classes)``
float32 logits. The normalisation the model was trained with is part of the exported
graph, so a consumer needs no constants from this project. The batch axis is dynamic.
The file is never put over an existing one unless ``overwrite=true`` (:func:`output_path`).
"""

from __future__ import annotations

import io
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from vit_mnist.errors import ConfigError, exit_on_user_error
from vit_mnist.io import atomic_write_bytes
from vit_mnist.settings import EXPORT_FORMATS, ExportSettings, check_settings
from vit_mnist.training.checkpointing import (
    checkpoint_datamodule,
    read_checkpoint,
    resolve_ckpt_path,
)
from vit_mnist.training.module import RUN_INFO_KEY, ViTClassifier


class PixelsToLogits(nn.Module):
    """``(B, 1, H, W)`` float pixels in [0, 1] -> normalise -> ViT -> ``(B, classes)`` logits.

    Args:
        net: the trained :class:`~vit_mnist.models.vit.VisionTransformer`.
        mean, std: the training data's normalisation (MNIST: 0.1307, 0.3081); 0 and 1 for
            data that was not normalised (the synthetic set).
    """

    def __init__(self, net: nn.Module, *, mean: float, std: float) -> None:
        super().__init__()
        self.net, self.mean, self.std = net, mean, std

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.net((pixels - self.mean) / self.std)


@dataclass
class ExportCheck:
    """How far the exported model is from PyTorch on the same images.

    Attributes:
        num_images: images compared.
        max_abs_diff: largest absolute difference of any logit (float32 units).
        classes_agree: images whose top class is the same in both, of ``num_images``.
        accuracy: the exported model's accuracy on their labels, a fraction in [0, 1].
    """

    num_images: int
    max_abs_diff: float
    classes_agree: int
    accuracy: float


# The batch axis of every exported file: any batch from 1 image up.
BATCH = torch.export.Dim("batch", min=1, max=65536)

# Said once per export in our words, in place of PyTorch's four FutureWarnings (torch 2.14
# deprecates torch.jit.trace, save and load).
TORCHSCRIPT_NOTE = (
    "note: PyTorch deprecates TorchScript (torch.jit); format=exported writes the format it "
    "recommends instead, a torch.export program (.pt2: torch.export.load(path).module())"
)


def export_model(model: PixelsToLogits, fmt: str, path: Path, *, opset: int = 18) -> None:
    """Write ``model`` (in eval mode, on the CPU) to ``path`` as ONNX, a ``torch.export``
    program or TorchScript.

    Args:
        model: the wrapped network.
        fmt: ``"onnx"`` (input ``images``, output ``logits``, dynamic axis ``batch``),
            ``"exported"`` (a ``torch.export`` program with a dynamic batch axis, read with
            ``torch.export.load(path).module()(images)``: PyTorch alone, no code of this
            project) or ``"torchscript"`` (a traced module: ``torch.jit.load(path)(images)``).
        path: the file to write; replaced atomically.
        opset: the ONNX opset version (of the default domain) of the file.

    Raises:
        ConfigError: an unknown ``fmt``, or an ``opset`` the exporter does not write this
            model in (nothing is written then).
        ImportError: ``fmt="onnx"`` without the ``onnx``/``onnxscript`` packages
            (``pip install -e '.[export]'``).
    """
    model = model.eval().cpu()
    example = torch.rand(2, 1, 28, 28)
    if fmt == "onnx":
        # The exporter's passes log every step at INFO, and a failed opset conversion as a
        # warning with a traceback; the opset written is checked below, in one line.
        for name in ("onnx_ir", "onnxscript", "torch.onnx"):
            logging.getLogger(name).setLevel(logging.ERROR)
        program = torch.onnx.export(
            model,
            (example,),
            input_names=["images"],
            output_names=["logits"],
            dynamic_shapes=({0: BATCH},),
            opset_version=opset,
            dynamo=True,
            verbose=False,
        )
        # torch.onnx writes its own opset and converts the graph to the one asked for; where
        # an operator has no form there (LayerNormalization before 17) it keeps its own.
        written = next(o.version for o in program.model_proto.opset_import if o.domain == "")
        if written != opset:
            raise ConfigError(
                f"opset={opset} cannot be written for this model: torch.onnx gave opset "
                f"{written} instead (it converts to another opset only where every operator "
                f"has a form there); use opset={written}"
            )
        data = program.model_proto.SerializeToString()

    elif fmt == "exported":
        with torch.no_grad():
            program = torch.export.export(model, (example,), dynamic_shapes=({0: BATCH},))
        buffer = io.BytesIO()
        torch.export.save(program, buffer)
        data = buffer.getvalue()

    elif fmt == "torchscript":
        # The tracer warns about the image-size check and the q/k/v split; both are fixed
        # by the architecture, not by the batch, so the trace is exact. PyTorch's
        # deprecation of torch.jit is said once, by export(), in TORCHSCRIPT_NOTE.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.simplefilter("ignore", FutureWarning)
            traced = torch.jit.trace(model, example)
            buffer = io.BytesIO()
            torch.jit.save(traced, buffer)
        data = buffer.getvalue()

    else:
        raise ConfigError(f"format={fmt!r} is unknown; use one of {list(EXPORT_FORMATS)}")
    atomic_write_bytes(path, data)


def run_exported(fmt: str, path: Path, pixels: torch.Tensor, batch_size: int = 384) -> torch.Tensor:
    """Logits of the exported file at ``path`` for ``pixels`` ``(N, 1, 28, 28)`` float32.

    ONNX files run in ONNX Runtime on its CPU provider, ``torch.export`` programs through
    ``torch.export.load`` alone, TorchScript files in ``torch.jit``. Fed in batches of
    ``batch_size`` and a smaller last one, which exercises the dynamic batch axis.

    Returns:
        ``(N, num_classes)`` float32 logits.
    """
    outputs = []
    if fmt == "onnx":
        import onnxruntime as ort

        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for chunk in pixels.split(batch_size):
            (logits,) = session.run(["logits"], {"images": chunk.numpy()})
            outputs.append(torch.from_numpy(logits))
    else:
        if fmt == "exported":
            loaded = torch.export.load(str(path)).module()
        else:
            with warnings.catch_warnings():  # said once, in TORCHSCRIPT_NOTE
                warnings.simplefilter("ignore", FutureWarning)
                loaded = torch.jit.load(str(path), map_location="cpu")
        with torch.no_grad():
            outputs = [loaded(chunk) for chunk in pixels.split(batch_size)]
    return torch.cat(outputs)


def check_export(
    model: PixelsToLogits, fmt: str, path: Path, pixels: torch.Tensor, labels: torch.Tensor
) -> ExportCheck:
    """Compare the exported model's logits with PyTorch's on the same pixels."""
    with torch.no_grad():
        expected = model.eval()(pixels)
    got = run_exported(fmt, path, pixels)
    return ExportCheck(
        num_images=len(pixels),
        max_abs_diff=(got - expected).abs().max().item(),
        classes_agree=int((got.argmax(1) == expected.argmax(1)).sum()),
        accuracy=(got.argmax(1) == labels).float().mean().item(),
    )


def sample_test_images(
    cfg: DictConfig, ckpt_path: Path, run_info: dict[str, Any], n: int, mean: float, std: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` test images of the checkpoint's dataset and their labels.

    Returns:
        Pixels ``(n, 1, 28, 28)`` float32 in [0, 1] and labels ``(n,)`` int64.
    """
    datamodule = checkpoint_datamodule(cfg, ckpt_path, run_info)
    datamodule.prepare_data()
    datamodule.setup("test")
    if hasattr(datamodule, "test_pixels"):
        return datamodule.test_pixels(n)
    images, labels = datamodule.data_test.tensors[:2]
    # Float test data is served normalised: undo that to get the pixels a user has.
    return images[:n].float() * std + mean, labels[:n]


def output_path(cfg: DictConfig, ckpt_path: Path) -> Path:
    """Where ``cfg`` asks the export to go: ``output``, or ``<run dir>/<checkpoint
    name><suffix>``, the suffix that :data:`~vit_mnist.settings.EXPORT_FORMATS` gives
    ``cfg.format``.

    Raises:
        ConfigError: ``output`` does not end in the format's suffix (``.onnx``, ``.pt2``, ``.pt``),
            or names a folder, or names an existing file and ``overwrite`` is not true.
    """
    fmt = str(cfg.format)
    suffix = EXPORT_FORMATS[fmt]
    output = cfg.get("output")
    if output:
        path = Path(str(output)).expanduser()
        if path.suffix.lower() != suffix:
            raise ConfigError(
                f"output={output} does not end in {suffix}, the suffix of format={fmt}; "
                f"use output={path.with_suffix(suffix)}"
            )
    else:
        path = Path(cfg.paths.output_dir) / (ckpt_path.stem + suffix)
    if path.is_dir():
        raise ConfigError(
            f"output={path} is a folder; give a file name, e.g. output={path / ('model' + suffix)}"
        )
    if path.exists() and not cfg.overwrite:
        raise ConfigError(
            f"output={path} exists already; add overwrite=true to replace it, or choose "
            "another output"
        )
    return path


def export(cfg: DictConfig) -> dict[str, Any]:
    """Export ``cfg.ckpt_path`` as ``cfg.format``, then check it on real test images.

    Returns:
        ``path`` of the exported file and the :class:`ExportCheck` fields.

    Raises:
        ConfigError: a setting that ``ExportSettings`` (vit_mnist/settings.py) refuses, or
            an ``output`` that :func:`output_path` refuses (checked before any work).
        CheckpointError: see :func:`vit_mnist.training.checkpointing.read_checkpoint`.
    """
    check_settings(cfg, ExportSettings)
    fmt = str(cfg.format)
    ckpt_path = resolve_ckpt_path(cfg)
    path = output_path(cfg, Path(ckpt_path))
    run_info = read_checkpoint(ckpt_path).get(RUN_INFO_KEY, {})
    module = ViTClassifier.load_from_checkpoint(ckpt_path, map_location="cpu", weights_only=True)
    data = run_info.get("data", {})
    # Synthetic data is not normalised: identity.
    mean, std = float(data.get("mean", 0.0)), float(data.get("std", 1.0))
    model = PixelsToLogits(module.net.float(), mean=mean, std=std).eval()

    export_model(model, fmt, path, opset=cfg.opset)
    pixels, labels = sample_test_images(cfg, ckpt_path, run_info, cfg.check_images, mean, std)
    check = check_export(model, fmt, path, pixels, labels)
    runtime = {"onnx": "ONNX Runtime", "exported": "torch.export"}.get(fmt, "TorchScript")
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")
    if fmt == "torchscript":
        print(TORCHSCRIPT_NOTE)
    print(
        f"{runtime} vs PyTorch on {check.num_images} test images: largest |logit difference| "
        f"= {check.max_abs_diff:.3g}; same predicted class on {check.classes_agree}/"
        f"{check.num_images}; accuracy {100 * check.accuracy:.2f}%"
    )
    return {"path": str(path), **check.__dict__}


@exit_on_user_error
def main(cfg: DictConfig) -> dict[str, Any]:
    """The body of ``python scripts/export.py ckpt_path=PATH format=onnx|exported|torchscript``."""
    if OmegaConf.is_missing(cfg, "ckpt_path"):
        raise ConfigError("ckpt_path is required: scripts/export.py ckpt_path=PATH format=onnx")
    return export(cfg)
