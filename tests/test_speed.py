"""The speed layer: every path gives the reference model's values and gradients, and
``auto`` chooses by measurement, caches, and never touches the model it times."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import assert_same_values_and_gradients, count_applies
from vit_mnist.errors import ConfigError
from vit_mnist.models.attention import MultiHeadSelfAttention
from vit_mnist.models.vit import VisionTransformer
from vit_mnist.speed import choose as choose_mod
from vit_mnist.speed.choose import candidates, choose
from vit_mnist.speed.forward import (
    ExplicitAttention,
    attention_forward,
    explicit_core,
    handwritten_backward_core,
    sdpa_core,
)
from vit_mnist.speed.paths import PATHS

CPU = torch.device("cpu")
TINY = dict(embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0)
EAGER = [n for n, p in PATHS.items() if not p.compiles]
COMPILED = [n for n, p in PATHS.items() if p.compiles]


def _skip_unavailable(name: str) -> None:
    why = PATHS[name].unavailable(CPU)
    if why is not None:
        pytest.skip(f"path {name} cannot run here: {why}")


def _grads(net: VisionTransformer, forward, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    net.zero_grad(set_to_none=True)
    out = forward(x)
    out.float().square().sum().backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    return out.detach(), grads


def _assert_same(name: str, causal: bool, patch_size: int, bf16: bool = False) -> None:
    torch.manual_seed(0)
    net = VisionTransformer(patch_size=patch_size, causal=causal, **TINY)
    x = torch.randn(3, 1, 28, 28)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        ref, ref_grads = _grads(net, net, x)
        out, grads = _grads(net, PATHS[name].build(net), x)
    tol = dict(atol=2e-2, rtol=2e-2) if bf16 else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out, ref, **tol)
    assert grads.keys() == ref_grads.keys()
    for key in ref_grads:
        # Every parameter gets a gradient, and it is the reference's.
        assert torch.isfinite(grads[key]).all(), key
        torch.testing.assert_close(grads[key], ref_grads[key], **tol, msg=key)


@pytest.mark.parametrize("patch_size", [4, 7])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", EAGER)
def test_eager_paths_give_the_reference_values_and_gradients(name, causal, patch_size):
    _skip_unavailable(name)
    _assert_same(name, causal, patch_size)


@pytest.mark.parametrize("name", EAGER)
def test_eager_paths_agree_under_bf16_autocast(name):
    _skip_unavailable(name)
    _assert_same(name, causal=False, patch_size=7, bf16=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILED)
def test_compiled_paths_give_the_reference_values_and_gradients(name):
    _skip_unavailable(name)
    _assert_same(name, causal=False, patch_size=7)


def test_paths_run_the_models_own_parameters():
    net = VisionTransformer(patch_size=7, **TINY)
    for name in EAGER:
        forward = PATHS[name].build(net)
        with torch.no_grad():
            before = forward(torch.ones(2, 1, 28, 28))
            net.head.bias.add_(1.0)  # a change to the model is a change to every path
            after = forward(torch.ones(2, 1, 28, 28))
            net.head.bias.sub_(1.0)
        torch.testing.assert_close(after, before + 1.0)


def test_forced_path_is_not_timed(monkeypatch):
    monkeypatch.setattr(choose_mod, "time_candidates", lambda *a, **k: pytest.fail("timed"))
    net = VisionTransformer(patch_size=7, **TINY)
    choice = choose(
        net, model_args=TINY, device=CPU, batch_size=8, path="fused", precision="32-true"
    )
    assert (choice.path, choice.precision, choice.how) == ("fused", "32-true", "forced")


def test_unknown_and_unavailable_paths_are_refused(monkeypatch):
    with pytest.raises(ConfigError, match=r"speed.path='warp' is unknown; use auto or one of"):
        candidates(CPU, "warp", "32-true", False)
    monkeypatch.setattr("vit_mnist.speed.paths.isa_class", lambda: "AVX2")
    with pytest.raises(ConfigError, match="speed.path=native cannot run here: needs AVX-512"):
        candidates(CPU, "native", "32-true", False)


def test_auto_leaves_out_what_cannot_run_or_compiles(monkeypatch):
    monkeypatch.setattr("vit_mnist.speed.paths.isa_class", lambda: "AVX2")
    monkeypatch.setattr("vit_mnist.speed.choose.has_native_bf16", lambda on_cuda: False)
    pairs, skipped = candidates(CPU, "auto", "auto", include_compiled=False)
    assert pairs == [(n, "32-true") for n in ("reference", "fused", "handwritten")]
    assert skipped["native"].startswith("needs AVX-512")
    assert "auto_compile" in skipped["compile"]
    monkeypatch.setattr("vit_mnist.speed.choose.has_native_bf16", lambda on_cuda: True)
    pairs, _ = candidates(CPU, "handwritten", "auto", include_compiled=False)
    assert pairs == [("handwritten", "32-true"), ("handwritten", "bf16-mixed")]


def test_auto_measures_picks_the_fastest_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("VIT_MNIST_CACHE", str(tmp_path))
    monkeypatch.setattr("vit_mnist.speed.choose.has_native_bf16", lambda on_cuda: False)
    torch.manual_seed(0)
    net = VisionTransformer(patch_size=7, **TINY)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    rng = torch.get_rng_state()
    args = dict(model_args=TINY, device=CPU, batch_size=16)
    first = choose(net, **args)
    assert first.how == "measured"
    assert first.images_per_s[f"{first.path} {first.precision}"] == max(first.images_per_s.values())
    assert set(first.images_per_s) >= {"reference 32-true", "fused 32-true"}
    # The timing ran on a copy and put the random-number state back.
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert (tmp_path / "speed_choices.json").is_file()
    start = time.perf_counter()
    second = choose(net, **args)
    assert second.how == "cached" and time.perf_counter() - start < 1.0
    assert (second.path, second.precision) == (first.path, first.precision)
    assert "cached in" in second.describe(CPU)
    # Another batch size is another measurement.
    assert choose(net, **{**args, "batch_size": 8}).how == "measured"


def test_isa_class_follows_aten_cpu_capability():
    code = (
        "from vit_mnist.speed.hardware import isa_class, has_native_bf16;"
        "import torch; from vit_mnist.speed.paths import PATHS;"
        "print(isa_class(), has_native_bf16(False),"
        "      PATHS['native'].unavailable(torch.device('cpu')))"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("default False needs AVX-512"), out


@pytest.mark.parametrize("qkv_bias", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("core", [explicit_core, sdpa_core, handwritten_backward_core])
def test_cls_only_attention_is_the_first_row_of_the_reference(core, causal, qkv_bias):
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(embed_dim=24, num_heads=3, causal=causal, qkv_bias=qkv_bias)
    x = torch.randn(2, 7, 24, requires_grad=True)
    full, cls = attn(x)[:, :1], attention_forward(attn, x, core, cls_only=True)
    assert cls.shape == (2, 1, 24)
    assert_same_values_and_gradients(cls, full, [x, attn.qkv.weight], atol=1e-6, rtol=1e-5)
    if causal:  # the CLS token then sees only itself: the other tokens cannot move it
        (grad_x,) = torch.autograd.grad(attention_forward(attn, x, core, True).sum(), [x])
        assert grad_x[:, 1:].abs().max() == 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t_q", [1, 7])
def test_handwritten_backward_passes_gradcheck(t_q, causal):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, t_q, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 3, 7, 4, dtype=torch.float64, generator=g) for _ in range(2))
    k.requires_grad_(), v.requires_grad_()
    # Non-contiguous inputs, as the module passes them (views of the qkv projection).
    q_t, k_t, v_t = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: ExplicitAttention.apply(q, k, v, 0.5, causal), (q_t, k_t, v_t)
    )


@pytest.mark.parametrize("causal", [False, True])
def test_handwritten_core_runs_only_where_a_backward_follows(causal, monkeypatch):
    calls = count_applies(monkeypatch, ExplicitAttention)
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(embed_dim=32, num_heads=4, causal=causal)
    x = torch.randn(3, 50, 32, requires_grad=True)
    fast = attention_forward(attn, x, handwritten_backward_core)
    assert calls == [1]
    with torch.no_grad():
        attention_forward(attn, x, handwritten_backward_core)  # no backward: step by step
    assert calls == [1]
    slow, _ = attn(x, need_weights=True)  # autograd through every textbook step
    params = [x, attn.qkv.weight, attn.qkv.bias, attn.proj.weight]
    assert_same_values_and_gradients(fast, slow, params, atol=1e-5, rtol=1e-5)


def test_handwritten_core_under_bf16_autocast_matches_float32():
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(embed_dim=64, num_heads=4)
    x = torch.randn(4, 50, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention_forward(attn, x, handwritten_backward_core)
    assert out.dtype == torch.bfloat16
    (grad_bf16,) = torch.autograd.grad(out.float().square().sum(), [attn.qkv.weight])
    ref = attn(x)
    (grad_ref,) = torch.autograd.grad(ref.square().sum(), [attn.qkv.weight])
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    # bf16 keeps 8 significant bits: the weight gradient within a few percent of its scale.
    assert (grad_bf16 - grad_ref).abs().max() < 0.03 * grad_ref.abs().max()


def test_a_damaged_cache_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("VIT_MNIST_CACHE", str(tmp_path))
    monkeypatch.setattr("vit_mnist.speed.choose.has_native_bf16", lambda on_cuda: False)
    net = VisionTransformer(patch_size=7, **TINY)
    args = dict(model_args=TINY, device=CPU, batch_size=8)
    for damage in ("[1, 2]", "not json", '{"KEY": {"path": "warp"}}'):
        (tmp_path / "speed_choices.json").write_text(damage)
        if "KEY" in damage:  # an entry under the right key that names no candidate
            key = choose_mod._cache_key(
                CPU, TINY, 8, choose_mod.candidates(CPU, "auto", "auto", False)[0]
            )
            (tmp_path / "speed_choices.json").write_text(damage.replace("KEY", key))
        assert choose(net, **args).how == "measured"
    assert choose(net, **args).how == "cached"


def test_compile_settings_apply_inside_and_restore_after():
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    from vit_mnist.speed.paths import compile_settings

    keys = [
        (dynamo_config, "specialize_float"),
        (functorch_config, "autograd_cache_allow_custom_autograd_functions"),
    ]
    keys = [(config, key) for config, key in keys if hasattr(config, key)]
    assert keys
    before = [getattr(config, key) for config, key in keys]
    with compile_settings():
        assert all(getattr(config, key) is True for config, key in keys)
    assert [getattr(config, key) for config, key in keys] == before
