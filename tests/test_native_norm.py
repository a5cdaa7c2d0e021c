"""The fused residual add and LayerNorm CPU kernel against PyTorch's add and LayerNorm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_same_values_and_gradients, count_applies
from vit_mnist.models import EncoderBlock, VisionTransformer, native


def kernel_builds() -> bool:
    return native.add_norm_usable(torch.zeros(1, 64), None, torch.nn.LayerNorm(64))


needs_kernel = pytest.mark.skipif(
    not kernel_builds(),
    reason="the fused add and LayerNorm kernel cannot be built here (no C++ compiler, no "
    "OpenMP or no AVX-512)",
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
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_out):
        s, y = native.add_norm(x, branch, norm, for_linear=True)
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


def ours(native_kernel: bool, **kwargs) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(embed_dim=32, depth=2, num_heads=2, patch_size=7, **kwargs)
    for m in model.modules():
        if isinstance(m, EncoderBlock | VisionTransformer):
            m.native_kernel = native_kernel
    return model


@needs_kernel
@pytest.mark.parametrize("bf16", [False, True])
def test_model_with_the_kernel_gives_pytorchs_numbers(bf16):
    fast, slow = ours(True), ours(False)
    x = torch.randn(4, 1, 28, 28)
    outs = []
    for model in (fast, slow):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            outs.append(model(x).float())
    tol = 2e-2 if bf16 else 1e-5  # bf16: one rounding boundary crossed moves a bf16 step
    for (name, a), b in zip(fast.named_parameters(), slow.parameters(), strict=True):
        assert torch.equal(a, b), name
    torch.testing.assert_close(*outs, atol=tol, rtol=tol)
    grads = [
        torch.autograd.grad(out.square().sum(), list(model.parameters()))
        for out, model in zip(outs, (fast, slow), strict=True)
    ]
    for (name, _), a, b in zip(fast.named_parameters(), *grads, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=name)


@needs_kernel
def test_forward_features_and_forward_agree_with_the_kernel():
    model = ours(True)
    x = torch.randn(3, 1, 28, 28)
    fast = model(x)  # the last block for the CLS token only
    full = model.forward_head(model.forward_features(x))
    assert_same_values_and_gradients(fast, full, list(model.parameters()), atol=1e-6, rtol=1e-5)


def calls_to_kernel(monkeypatch) -> list[int]:
    return count_applies(monkeypatch, native.AddLayerNorm)


@needs_kernel
def test_kernel_runs_in_cpu_training_steps_only(monkeypatch):
    calls = calls_to_kernel(monkeypatch)
    model = ours(True)
    x = torch.randn(2, 1, 28, 28)
    model(x)  # depth 2: norm1 and norm2 of block 0, norm1 of block 1 (the CLS-only block)
    assert len(calls) == 3
    model.forward_features(x)  # 4 in the blocks, and the final norm
    assert len(calls) == 8
    with torch.no_grad():
        model(x)  # inference: PyTorch's operations, the reference numbers
    model.forward_with_attention(x)  # the attention weights' path: plain blocks
    ours(False)(x)
    model.double()(x.double())  # float64: not a dtype the kernel takes
    assert len(calls) == 8


@needs_kernel
def test_the_environment_variable_turns_the_kernel_off(monkeypatch):
    calls = calls_to_kernel(monkeypatch)
    monkeypatch.setenv("VIT_MNIST_NATIVE_ATTENTION", "0")
    ours(True)(torch.randn(2, 1, 28, 28))
    assert calls == []


def test_without_a_compiler_it_warns_and_pytorchs_operations_run(monkeypatch, tmp_path):
    monkeypatch.setenv("VIT_MNIST_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    native._norm_library.cache_clear()
    native._library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler found"):
            assert not native.add_norm_usable(torch.zeros(2, 48), None, torch.nn.LayerNorm(48))
        model = ours(True)
        model(torch.randn(2, 1, 28, 28)).sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        assert not any((tmp_path / "kernels").glob("*"))  # nothing half-built left behind
    finally:
        native._norm_library.cache_clear()
        native._library.cache_clear()


@needs_kernel
def test_torch_compile_traces_pytorchs_operations_instead(monkeypatch):
    # Inductor fuses the add and the LayerNorm itself; the kernel stays out of the graph.
    calls = calls_to_kernel(monkeypatch)
    model = ours(True)
    x = torch.randn(2, 1, 28, 28)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), ours(False)(x), atol=0, rtol=0)
    assert calls == []
