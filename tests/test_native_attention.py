"""The fused CPU attention kernel against the explicit path on PyTorch operations.

The reference for the kernel's bits is the explicit arithmetic as the training step runs it
without the kernel: :class:`~vit_mnist.speed.forward.ExplicitAttention` (the hand-written
backward's core, which scales Q K^T in float32 before rounding, as the kernel does), on the
same module's parameters. The module itself, ``attn(x)``, is checked too in float32.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.helpers import assert_same_values_and_gradients, count_applies
from vit_mnist.hardware import cpuinfo_flags
from vit_mnist.models import MultiHeadSelfAttention, VisionTransformer
from vit_mnist.speed import native
from vit_mnist.speed.choose import PATHS
from vit_mnist.speed.forward import attention_forward, handwritten_backward_core
from vit_mnist.speed.native import native_core

# Depends on the CPU's instruction set: CI runs it again under AVX2 emulation (.ci/run).
pytestmark = pytest.mark.isa

CPU = torch.device("cpu")


def _attention(attn: MultiHeadSelfAttention, x: torch.Tensor, cls: bool) -> torch.Tensor:
    """The native path's attention: the kernel where it applies."""
    return attention_forward(attn, x, native_core, cls)


# Where the kernel's bf16 products run on vdpbf16ps and oneDNN's do too (no AMX tiles, whose
# sums may be taken in another order), the kernel has given the PyTorch path's exact bits
# (the README's kernel notes, now docs/speed.md); elsewhere, within a bf16 step.
_FLAGS = cpuinfo_flags()
AVX512_BF16 = "avx512_bf16" in _FLAGS and "amx_bf16" not in _FLAGS

_WHY_NOT = PATHS["native"].unavailable(CPU)
needs_kernel = pytest.mark.skipif(
    _WHY_NOT is not None, reason=f"the native path cannot run here: {_WHY_NOT}"
)
# The build for the class PyTorch runs at here. The AVX2 build (8-float vectors) that an
# AVX2 CPU gets is tested by CI's second pass, under ATEN_CPU_CAPABILITY=avx2 (.ci/run).
TARGETS = [native.build_target()] if _WHY_NOT is None else []


# (65, 64, 2), 32-float heads, shares its build (keys per block, vectors per head row) with
# (65, 40, 2) at 8 and at 16 floats a vector; each bf16 shape shares one with a float32
# shape at 8 floats: every build costs a compiler run of seconds (4 at AVX2).
FLOAT32_SHAPES = [(50, 64, 4), (17, 16, 2), (65, 40, 2), (65, 64, 2), (1, 32, 2), (128, 128, 2)]
BF16_SHAPES = [(50, 64, 4), (17, 16, 2), (65, 40, 2), (65, 96, 3), (17, 10, 2)]


@pytest.fixture(scope="module", autouse=True)
def kernels_built_first():
    """Every library this module's tests load, built before them: a build is one compiler
    process on one core, about 4 s per shape class and target on an AVX2 core. Alone, two
    builds at a time; under xdist, one per worker, the second worker from the other end of
    the list: both workers built every library at once before (20 to 25 s each), and now
    each finds the other's builds in the shared cache (tests/conftest.py)."""
    builds = sorted(
        {
            (t, *native.attention_defines(tokens, dim // heads, native.LANES[t]))
            for t in TARGETS
            for tokens, dim, heads in FLOAT32_SHAPES + BF16_SHAPES
        }
    )
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and int(worker.removeprefix("gw")) % 2:
        builds.reverse()
    with ThreadPoolExecutor(max_workers=1 if worker else 2) as pool:
        list(pool.map(lambda build: native.library("attention", *build), builds))


@pytest.fixture(params=TARGETS or [None])
def target(request, monkeypatch) -> str:
    """The kernel's build target for this test (see TARGETS)."""
    if request.param is None:
        pytest.skip(f"the native path cannot run here: {_WHY_NOT}")
    monkeypatch.setattr(native, "build_target", lambda: request.param)
    return request.param


def both_ways(attn: MultiHeadSelfAttention, x: torch.Tensor, bf16: bool, cls: bool = False):
    """The output in the kernel and on the explicit path's PyTorch operations (the same
    module, the same input); with ``cls`` the CLS token's row only."""
    outs = []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        outs.append(_attention(attn, x, cls).float())
        outs.append(attention_forward(attn, x, handwritten_backward_core, cls).float())
    return outs


def seeded_attention(tokens, embed_dim, num_heads, causal, batch):
    """An explicit-path attention module and an input (batch, tokens, embed_dim), seed 0."""
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(
        embed_dim=embed_dim, num_heads=num_heads, causal=causal, impl="explicit"
    )
    return attn, torch.randn(batch, tokens, embed_dim, requires_grad=True)


@needs_kernel
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tokens,embed_dim,num_heads", FLOAT32_SHAPES)
def test_kernel_gives_the_explicit_paths_numbers_in_float32(
    tokens, embed_dim, num_heads, causal, target
):
    attn, x = seeded_attention(tokens, embed_dim, num_heads, causal, batch=3)
    params = [x, attn.qkv.weight, attn.qkv.bias, attn.proj.weight]
    for cls in (False, True):
        fast, slow = both_ways(attn, x, bf16=False, cls=cls)
        assert_same_values_and_gradients(fast, slow, params, atol=1e-5, rtol=1e-5)
    # And the module itself, the model as written (its CLS row for the CLS-only form).
    for cls in (False, True):
        fast, slow = _attention(attn, x, cls), attn(x)
        slow = slow[:, :1] if cls else slow
        assert_same_values_and_gradients(fast, slow, params, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tokens,embed_dim,num_heads", BF16_SHAPES)
def test_kernel_gives_the_explicit_paths_numbers_under_bf16_autocast(
    tokens, embed_dim, num_heads, causal, target
):
    # The same roundings to bfloat16 as the explicit path; a sum taken in another order can
    # land one bfloat16 step (2**-8 relative) away. Odd head_dim (5) and token counts
    # exercise the kernel's pairs of features, keys and queries.
    attn, x = seeded_attention(tokens, embed_dim, num_heads, causal, batch=4)
    for cls in (False, True):
        fast, slow = both_ways(attn, x, bf16=True, cls=cls)
        params = [x, attn.qkv.weight, attn.proj.weight]
        if AVX512_BF16 and target == "AVX-512":
            assert_same_values_and_gradients(fast, slow, params, atol=0, rtol=0)
        else:
            assert_same_values_and_gradients(fast, slow, params, atol=2e-2, rtol=2e-2)
        # Most elements are bit-identical: the kernel is not merely close.
        assert (fast == slow).float().mean() > 0.9


def test_native_path_gives_the_models_values_and_gradients(target, monkeypatch):
    # The whole model on each build: at AVX2 the attention kernel with PyTorch's add and
    # LayerNorm (their kernel is AVX-512 only), at AVX-512 both kernels.
    calls = calls_to_kernel(monkeypatch)
    torch.manual_seed(0)
    model = VisionTransformer(embed_dim=64, depth=2, num_heads=4, patch_size=4)
    x = torch.randn(3, 1, 28, 28)
    fast, slow = PATHS["native"].build(model)(x), model(x)
    assert_same_values_and_gradients(fast, slow, list(model.parameters()), atol=1e-5, rtol=1e-5)
    assert len(calls) == 2  # the kernel in both blocks (the last for the CLS query only)


def calls_to_kernel(monkeypatch) -> list[int]:
    return count_applies(monkeypatch, native.FusedCPUAttention)


@needs_kernel
def test_kernel_runs_only_for_the_explicit_paths_training_step(monkeypatch):
    calls = calls_to_kernel(monkeypatch)
    x = torch.randn(2, 50, 64, requires_grad=True)
    attn = MultiHeadSelfAttention(embed_dim=64, num_heads=4)
    _attention(attn, x, False)
    _attention(attn, x, True)
    assert len(calls) == 2
    with torch.no_grad():
        _attention(attn, x, False)  # inference: the explicit path's operations, nothing to save
    _attention(MultiHeadSelfAttention(embed_dim=64, num_heads=4, attn_dropout=0.1), x, False)
    long = torch.randn(1, 129, 64, requires_grad=True)  # more tokens than the kernel holds
    _attention(MultiHeadSelfAttention(embed_dim=64, num_heads=4), long, False)
    half = MultiHeadSelfAttention(embed_dim=64, num_heads=4).half()
    _attention(half, x.detach().half().requires_grad_(), False)  # float16: not for the kernel
    attn(x)  # the model as written never calls it, nor its attention weights' path
    attn(x, need_weights=True)
    MultiHeadSelfAttention(embed_dim=64, num_heads=4, impl="fused")(x)
    assert len(calls) == 2


def test_native_path_is_offered_at_avx2_and_avx512_only(monkeypatch):
    monkeypatch.setattr("vit_mnist.speed.native.isa_class", lambda: "ARM")
    reason = PATHS["native"].unavailable(CPU)
    assert reason is not None and reason.startswith("needs AVX2 or AVX-512")
    assert PATHS["native"].unavailable(torch.device("meta")) == "CPU only"
    # PyTorch at AVX2 (an AVX2 CPU, or ATEN_CPU_CAPABILITY=avx2): the 8-float build, no
    # LayerNorm kernel (AVX-512 intrinsics only).
    monkeypatch.setattr("vit_mnist.speed.native.isa_class", lambda: "AVX2")
    assert (native.build_target(), native.lanes()) == ("AVX2", 8)
    assert not native.add_norm_usable(torch.zeros(2, 64), None, torch.nn.LayerNorm(64))
    monkeypatch.setattr("vit_mnist.speed.native.isa_class", lambda: "AVX512-BF16")
    assert (native.build_target(), native.lanes()) == ("AVX-512", 16)


@needs_kernel
def test_build_is_cached_and_leaves_no_partial_file(monkeypatch, tmp_path):
    monkeypatch.setenv("VIT_MNIST_CACHE", str(tmp_path))
    build = lambda: native.build("attention", ("-DATTN_NB=2", "-DATTN_DV=1"))  # noqa: E731
    first = build()
    assert first.parent == tmp_path / "kernels" and first.stat().st_size > 0
    mtime = first.stat().st_mtime_ns
    assert build() == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no *.tmp left over


@needs_kernel
def test_without_a_compiler_it_warns_and_the_explicit_path_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("VIT_MNIST_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    native.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler found"):
            assert native.kernel_for(torch.zeros(1, 17, 48), None, 1) is None
        attn = MultiHeadSelfAttention(embed_dim=16, num_heads=1)
        x = torch.randn(2, 17, 16, requires_grad=True)
        out = _attention(attn, x, False)
        out.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
        assert not any((tmp_path / "kernels").glob("*"))  # nothing half-built left behind
    finally:
        native.library.cache_clear()


@needs_kernel
def test_a_kernel_that_cannot_be_built_is_said_and_left_out(monkeypatch, tmp_path):
    from omegaconf import OmegaConf

    from vit_mnist.errors import ConfigError
    from vit_mnist.speed.choose import prepare_speed
    from vit_mnist.training.module import ViTClassifier

    def config(path: str):
        return OmegaConf.create(
            {
                "speed": {"path": path, "compile": False},
                "trainer": {"accelerator": "cpu", "precision": "32-true"},
                "data": {"batch_size": 8},
                "model": model,
            }
        )

    monkeypatch.setenv("VIT_MNIST_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")  # a compiler that fails every build
    native.library.cache_clear()
    native.FAILURES.clear()
    try:
        model = dict(patch_size=7, embed_dim=32, depth=1, num_heads=2)
        module = ViTClassifier(model=model)
        # Said once, before training, with why.
        with pytest.warns(RuntimeWarning, match="attention kernel is not .*/bin/false failed"):
            choice = prepare_speed(module, config("auto"))
        # The path that runs is the one recorded in metrics.json; the log line says why
        # native was not timed.
        assert choice.path != "native" and "/bin/false failed" in choice.skipped["native"]
        assert "not timed: " in choice.describe(CPU) and "native (" in choice.describe(CPU)
        assert choice.metrics()["speed_path"] == choice.path
        assert not any(k.startswith("native") for k in choice.metrics()["speed_images_per_s"])
        # A forced path that cannot run is refused, saying why.
        with pytest.raises(ConfigError, match="speed.path=native cannot run here: .*false failed"):
            prepare_speed(module, config("native"))
    finally:
        native.library.cache_clear()
        native.FAILURES.clear()
