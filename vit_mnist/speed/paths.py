"""The named ways of running the reference model's training step.

Each :class:`TrainingPath` turns a :class:`~vit_mnist.models.vit.VisionTransformer` into a
callable ``images (B, C, H, W) -> logits (B, num_classes)`` (with ``heads=True``, a
distilled ViT's two heads' logits, which its loss needs) that runs the model's own
parameters (nothing is copied, so the optimizer, the checkpoints and the attention maps
see one model) and gives the reference's values and gradients to float rounding
(tests/test_speed.py). Which one is fastest depends on the machine: see
:mod:`vit_mnist.speed.choose`, which times them on the user's own.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vit_mnist.models.vit import VisionTransformer
from vit_mnist.speed import native
from vit_mnist.speed.forward import (
    handwritten_backward_core,
    sdpa_core,
    vit_forward,
)
from vit_mnist.speed.hardware import cpuinfo_flags, isa_class
from vit_mnist.speed.native_forward import native_vit_forward

Forward = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TrainingPath:
    """A named way to run the training step.

    Attributes:
        name: what ``speed.path=NAME`` selects.
        summary: one line for logs and ``--help`` texts.
        build: model -> its forward on this path (the model's own modules).
        unavailable: device -> why this path cannot run there, or None where it can.
        compiles: whether the first training step compiles (30-60 s for a model's first
            compile on a 2-core CPU); evaluation, without gradients, runs eagerly.
        unsupported: model -> why this path cannot run it, or None where it can.
        eager: for a compiled path, the eager path that stands for it where the precision
            is chosen (:func:`vit_mnist.speed.choose.choose`); None for an eager path.
    """

    name: str
    summary: str
    build: Callable[[VisionTransformer], Forward]
    unavailable: Callable[[torch.device], str | None]
    compiles: bool = False
    unsupported: Callable[[VisionTransformer], str | None] = lambda net: None
    eager: str | None = None


def _always(device: torch.device) -> None:
    return None


def _vit_only(net: nn.Module) -> str | None:
    """Why a path written for the ViT's blocks cannot run ``net``: a convnet has none."""
    if not isinstance(net, VisionTransformer):
        return "a convnet (model=cnn) runs on the reference path"
    return None


def _reference(net: nn.Module) -> Forward:
    """The model as written: ``net(x)``, or with ``heads=True`` (a distilled ViT) the pair
    of its CLS and distillation heads' logits."""

    def forward(x: torch.Tensor, heads: bool = False) -> Any:
        return net.forward_heads(net.forward_features(x)) if heads else net(x)

    return forward


def _native_unsupported(net: VisionTransformer) -> str | None:
    """Why the C++ attention kernel does not take ``net``: it is built and tested for
    h * d_k == D in every block, which a model with pruned heads breaks; or it cannot be
    built here (no working compiler, an unwritable cache); or :func:`_vit_only`."""
    if why := _vit_only(net):
        return why
    for i, block in enumerate(net.blocks):
        attn = block.attn
        if attn.num_heads * attn.head_dim != attn.embed_dim:
            return (
                f"block {i} has {attn.num_heads} heads of {attn.head_dim} features, not "
                f"embed_dim={attn.embed_dim} (pruned heads); the C++ kernel assumes them equal"
            )
    # Built now for this model's shape (or found built): a kernel that cannot be built
    # leaves the path out, rather than running it on PyTorch's operations under its name.
    return native.build_failure(net.num_tokens, net.blocks[0].attn.head_dim)


@contextlib.contextmanager
def compile_settings() -> Iterator[None]:
    """torch.compile settings for the ``compile`` path: they cut compile time, not speed.
    ``torch._dynamo.config.specialize_float=True`` traces float module attributes (dropout
    ``p``, LayerNorm ``eps``) as the constants they are, instead of as symbols that are
    specialised later with a restart of the whole analysis. Left out where this torch
    version lacks it."""
    import torch._dynamo.config as config

    with (
        config.patch(specialize_float=True)
        if hasattr(config, "specialize_float")
        else (contextlib.nullcontext())
    ):
        yield


class _PathModule(nn.Module):
    """``function(net, x)`` as a module, for torch.compile. ``net`` is held outside the
    module tree, so nothing here is a second copy of its parameters."""

    def __init__(self, net: VisionTransformer, function: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        object.__setattr__(self, "net", net)
        self.function = function

    def forward(self, x: torch.Tensor, heads: bool = False) -> Any:
        return self.function(self.net, x, heads=heads)


def _compiled(function: Callable[..., torch.Tensor]) -> Callable[[VisionTransformer], Forward]:
    def build(net: VisionTransformer) -> Forward:
        # dynamic=True: one graph serves every batch size (an epoch's last, smaller batch
        # too); inductor caches the compiled code on disk.
        compiled = torch.compile(_PathModule(net, function), dynamic=True)

        def forward(x: torch.Tensor, heads: bool = False) -> Any:
            # The training step alone is compiled. Without gradients (validation, test)
            # the same function runs eagerly: a graph of its own would cost a first
            # compile of its own (11 to 27 s on 2 cores) for a forward pass that is a
            # few seconds of a whole run (docs/speed.md).
            if not torch.is_grad_enabled():
                return function(net, x, heads=heads)
            with compile_settings():
                return compiled(x, heads=heads)

        return forward

    return build


def _compile_unavailable(device: torch.device) -> str | None:
    if device.type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler  # loads the compiler package
        from torch._inductor.exc import InvalidCxxCompiler

        try:
            get_cpp_compiler()
        except InvalidCxxCompiler:
            return "no working C++ compiler (install g++)"
        return None
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed"
        return None
    return f"not supported on {device.type}"


def _native_unavailable(device: torch.device) -> str | None:
    if device.type != "cpu":
        return "CPU only"
    target = native.build_target()
    if target is None:
        return f"needs AVX2 or AVX-512, this CPU runs PyTorch at {isa_class()}"
    if target == "AVX-512" and not {"avx512f", "avx512bw", "avx512vl"} <= cpuinfo_flags():
        return "needs AVX-512 F, BW and VL"
    if not torch.backends.openmp.is_available():
        return "this torch build has no OpenMP"
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        return "no C++ compiler found (install g++)"
    return None


PATHS: dict[str, TrainingPath] = {
    p.name: p
    for p in (
        TrainingPath(
            "reference",
            "the model as written (vit_mnist/models), autograd's backward",
            _reference,
            _always,
        ),
        TrainingPath(
            "fused",
            "scaled_dot_product_attention; last block for the CLS token only",
            lambda net: functools.partial(vit_forward, net, core=sdpa_core),
            _always,
            unsupported=_vit_only,
        ),
        TrainingPath(
            "handwritten",
            "explicit attention with a hand-written backward; last block for the CLS token only",
            lambda net: functools.partial(vit_forward, net, core=handwritten_backward_core),
            _always,
            unsupported=_vit_only,
        ),
        TrainingPath(
            "compile",
            "torch.compile (inductor) of the explicit forward; last block for the CLS token only",
            _compiled(vit_forward),
            _compile_unavailable,
            compiles=True,
            unsupported=_vit_only,
            eager="handwritten",
        ),
        TrainingPath(
            "native",
            "C++ kernels for attention (AVX2, AVX-512) and residual add + LayerNorm (AVX-512)",
            lambda net: functools.partial(native_vit_forward, net),
            _native_unavailable,
            unsupported=_native_unsupported,
        ),
    )
}
