"""The fused residual add and LayerNorm CPU kernel against PyTorch's add and LayerNorm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_same_values_and_gradients, count_applies
from vit_mnist.models import VisionTransformer
from vit_mnist.speed import native
from vit_mnist.speed.choose import PATHS
from vit_mnist.speed.forward import attention_forward
from vit_mnist.speed.native import native_core

# Depends on the CPU's instruction set: CI runs it again under AVX2 emulation (.ci/run).
pytestmark = pytest.mark.isa

_WHY_NOT = PATHS["native"].unavailable(torch.device("cpu"))
if _WHY_NOT is None and native.build_target() != "AVX-512":
    _WHY_NOT = "the LayerNorm kernel is for AVX-512 only; PyTorch runs at AVX2 here"
needs_kernel = pytest.mark.skipif(
    _WHY_NOT is not None, reason=f"the native path cannot run here: {_WHY_NOT}"
)


def seeded(dim: int, branch_dtype: torch.dtype | None, rows: tuple[int, ...] = (3, 7)):
    """A LayerNorm with random weight and bias, x (off-centre, so that the mean matters)
    and a branch of ``branch_dtype`` (None: no branch), all requiring grad. Seed 0."""
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(dim)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = (torch.randn(*rows, dim) * 2 + 0.5).requires_grad_()
    branch = None
    if branch_dtype is not None:
        branch = torch.randn(*rows, dim).to(branch_dtype).requires_grad_()
    return norm, x, branch


def pytorch_add_norm(x, branch, norm, bf16_out: bool):
    s = x if branch is None else x + branch
    y = F.layer_norm(s, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    return s, y.bfloat16() if bf16_out else y


@needs_kernel
@pytest.mark.parametrize("bf16_out", [False, True])
@pytest.mark.parametrize("branch_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 20, 64, 100, 192, 256])
def test_kernel_gives_pytorchs_numbers(dim, branch_dtype, bf16_out):
    # 21 rows: not a multiple of the 4 rows the forward takes at a time; D = 20 and 100
    # end in a part-filled vector.
    norm, x, branch = seeded(dim, branch_dtype)
    assert native.add_norm_usable(x, branch, norm)  # the kernel, not PyTorch's fallback
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_out):
        s, y = native.add_norm(x, branch, norm)
    ref_s, ref_y = pytorch_add_norm(x, branch, norm, bf16_out)
    assert s.dtype == torch.float32 and y.dtype == ref_y.dtype
    assert torch.equal(s, ref_s)  # the same one float32 add
    inputs = [t for t in (x, branch, norm.weight, norm.bias) if t is not None]
    # Gradients through both outputs, as in a block (s goes on down the residual stream).
    grad_s, grad_y = torch.randn_like(s), torch.randn(y.shape).to(y.dtype)
    got = torch.autograd.grad([s, y], inputs, [grad_s, grad_y])
    want = torch.autograd.grad([ref_s, ref_y], inputs, [grad_s, grad_y])
    if bf16_out:
        # Rounded from float32 values 1e-6 apart: the same bfloat16 but near a boundary.
        assert (y == ref_y).float().mean() > 0.98
        torch.testing.assert_close(y, ref_y, atol=0, rtol=2**-7)
    else:
        torch.testing.assert_close(y, ref_y, atol=2e-6, rtol=2e-6)
    names = ["x", "weight", "bias"] if branch is None else ["x", "branch", "weight", "bias"]
    for name, a, b in zip(names, got, want, strict=True):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a.float(), b.float(), atol=1e-5, rtol=1e-5, msg=name)


def ours(**kwargs) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(embed_dim=32, depth=2, num_heads=2, patch_size=7, **kwargs)


def native_full_forward(net: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """The native path with every block run for all tokens (none CLS-only): the
    last block's MLP branch meets the final LayerNorm in the kernel."""
    x, branch = net.embed(x), None
    for block in net.blocks:
        x, h = native.add_norm(x, branch, block.norm1)
        x, h = native.add_norm(x, attention_forward(block.attn, h, native_core), block.norm2)
        branch = block.mlp(h)
    return net.forward_head(native.add_norm(x, branch, net.norm)[1])


@needs_kernel
@pytest.mark.parametrize("bf16", [False, True])
def test_native_forward_gives_the_models_numbers(bf16):
    model = ours()
    x = torch.randn(4, 1, 28, 28)
    outs = []
    for forward in (PATHS["native"].build(model), model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            outs.append(forward(x).float())
    tol = 2e-2 if bf16 else 1e-5  # bf16: one rounding boundary crossed moves a bf16 step
    torch.testing.assert_close(*outs, atol=tol, rtol=tol)
    grads = [torch.autograd.grad(out.square().sum(), list(model.parameters())) for out in outs]
    for (name, _), a, b in zip(model.named_parameters(), *grads, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=name)


@needs_kernel
def test_cls_only_and_full_last_block_agree_with_the_kernel():
    model = ours()
    x = torch.randn(3, 1, 28, 28)
    fast = PATHS["native"].build(model)(x)  # the last block for the CLS token only
    full = native_full_forward(model, x)
    assert_same_values_and_gradients(fast, full, list(model.parameters()), atol=1e-6, rtol=1e-5)


def calls_to_kernel(monkeypatch) -> list[int]:
    return count_applies(monkeypatch, native.AddLayerNorm)


@needs_kernel
def test_kernel_runs_in_cpu_training_steps_only(monkeypatch):
    calls = calls_to_kernel(monkeypatch)
    model = ours()
    x = torch.randn(2, 1, 28, 28)
    PATHS["native"].build(model)(x)  # depth 2: norm1 and norm2 of block 0, norm1 of block 1
    assert len(calls) == 3
    native_full_forward(model, x)  # 4 in the blocks, and the final norm
    assert len(calls) == 8
    with torch.no_grad():
        PATHS["native"].build(model)(x)  # inference: PyTorch's operations, the reference numbers
    model(x)  # the model as written never calls it, nor its attention weights' path
    model.forward_with_attention(x)
    model.double()
    PATHS["native"].build(model)(x.double())  # float64: not a dtype the kernel takes
    assert len(calls) == 8


@needs_kernel
def test_without_a_compiler_it_warns_and_pytorchs_operations_run(monkeypatch, tmp_path):
    monkeypatch.setenv("VIT_MNIST_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    native.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler found"):
            assert not native.add_norm_usable(torch.zeros(2, 48), None, torch.nn.LayerNorm(48))
        model = ours()
        with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler found"):
            PATHS["native"].build(model)(torch.randn(2, 1, 28, 28)).sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        assert not any((tmp_path / "kernels").glob("*"))  # nothing half-built left behind
    finally:
        native.library.cache_clear()
