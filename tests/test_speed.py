"""The speed layer: every path gives the reference model's values and gradients, and
``auto`` chooses by measurement, caches, and never touches the model it times."""

from __future__ import annotations

import json
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
from vit_mnist.speed import allocator as malloc
from vit_mnist.speed import choose as choose_mod
from vit_mnist.speed.choose import candidates, choose
from vit_mnist.speed.forward import (
    ExplicitAttention,
    attention_forward,
    block_forward,
    embed_forward,
    explicit_core,
    handwritten_backward_core,
    sdpa_core,
)
from vit_mnist.speed.paths import PATHS

# Depends on the CPU's instruction set: CI runs it again under AVX2 emulation (.ci/run).
pytestmark = pytest.mark.isa

CPU = torch.device("cpu")
TINY = dict(embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0)
EAGER = [n for n, p in PATHS.items() if not p.compiles]
COMPILED = [n for n, p in PATHS.items() if p.compiles]


@pytest.fixture(autouse=True)
def mallopt_calls(monkeypatch) -> list[dict[int, int]]:
    """The malloc mode is the whole process's, and glibc cannot go back once it is set:
    here mallopt is recorded, not called, so the test process keeps glibc as it is."""
    calls: list[dict[int, int]] = []
    monkeypatch.setattr(malloc, "_mallopt", lambda settings: calls.append(dict(settings)))
    monkeypatch.setattr(malloc, "_state", {"mode": "system", "set": False})
    return calls


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


def _assert_same(
    name: str, causal: bool, patch_size: int, bf16: bool = False, device: torch.device = CPU
) -> None:
    torch.manual_seed(0)
    net = VisionTransformer(patch_size=patch_size, causal=causal, **TINY).to(device)
    x = torch.randn(3, 1, 28, 28, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
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


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_paths_evaluate_without_compiling(name, monkeypatch):
    """Only the training step is compiled: without gradients (validation, test) the path's
    function runs eagerly, with the reference's logits."""
    _skip_unavailable(name)

    def no_compile(module, **kwargs):
        return lambda x: pytest.fail("the evaluation forward went to torch.compile")

    monkeypatch.setattr(torch, "compile", no_compile)
    torch.manual_seed(0)
    net = VisionTransformer(patch_size=7, **TINY).eval()
    forward = PATHS[name].build(net)
    x = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(forward(x), net(x), atol=1e-5, rtol=1e-4)
    with torch.inference_mode():
        torch.testing.assert_close(forward(x), net(x), atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("name", list(PATHS))
def test_paths_give_the_reference_values_and_gradients_on_cuda(name, bf16):
    cuda = torch.device("cuda")
    why = PATHS[name].unavailable(cuda)
    if why is not None:
        pytest.skip(f"path {name} cannot run on CUDA: {why}")
    _assert_same(name, causal=False, patch_size=7, bf16=bf16, device=cuda)


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


def test_patch_embedding_as_a_matrix_product_is_the_convolution():
    """Three channels, so that flattening a patch in another order than the conv weight's
    (C, p, p) would show; values and gradients of every embedding parameter."""
    torch.manual_seed(0)
    net = VisionTransformer(img_size=12, patch_size=4, in_chans=3, **TINY)
    x = torch.randn(2, 3, 12, 12)
    params = dict(net.named_parameters())
    keys = ("patch_embed.proj.weight", "patch_embed.proj.bias", "cls_token", "pos_embed")
    ref = net._embed(x)
    out = embed_forward(net, x)
    torch.testing.assert_close(out, ref)
    weights = torch.randn_like(ref)  # a loss whose gradient differs per token and feature
    ref_grads = torch.autograd.grad((ref * weights).sum(), [params[k] for k in keys])
    grads = torch.autograd.grad((out * weights).sum(), [params[k] for k in keys])
    for key, grad, ref_grad in zip(keys, grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, msg=key)
    with pytest.raises(ValueError, match="img_size=12"):
        embed_forward(net, torch.randn(2, 3, 16, 16))


@pytest.mark.parametrize("bf16", [False, True])
def test_block_keeps_the_reference_residual_stream(bf16):
    """The residual adds written over the branch's buffer: same values, and under bf16
    autocast the stream stays float32 as in the reference (a bf16 branch must not take
    the sum)."""
    torch.manual_seed(0)
    net = VisionTransformer(patch_size=7, **TINY)
    x = torch.randn(2, 17, TINY["embed_dim"])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        ref = net.blocks[0](x)
        for core in (explicit_core, handwritten_backward_core, sdpa_core):
            out = block_forward(net.blocks[0], x, core)
            assert out.dtype == ref.dtype == torch.float32
            torch.testing.assert_close(out, ref, atol=2e-2 if bf16 else 1e-5, rtol=1e-4)


def test_forced_path_is_not_timed(monkeypatch):
    monkeypatch.setattr(choose_mod, "time_candidates", lambda *a, **k: pytest.fail("timed"))
    net = VisionTransformer(patch_size=7, **TINY)
    choice = choose(
        net,
        model_args=TINY,
        device=CPU,
        batch_size=8,
        path="fused",
        precision="32-true",
        allocator="system",
    )
    assert (choice.path, choice.precision, choice.how) == ("fused", "32-true", "forced")


def test_unknown_and_unavailable_paths_are_refused(monkeypatch):
    with pytest.raises(ConfigError, match=r"speed.path='warp' is unknown; use auto or one of"):
        candidates(CPU, "warp", "32-true", False)
    monkeypatch.setattr("vit_mnist.speed.native.isa_class", lambda: "ARM")
    with pytest.raises(ConfigError, match="speed.path=native cannot run here: needs AVX2 or AVX-"):
        candidates(CPU, "native", "32-true", False)


def test_auto_leaves_out_what_cannot_run_or_compiles(monkeypatch):
    monkeypatch.setattr("vit_mnist.speed.native.isa_class", lambda: "ARM")
    monkeypatch.setattr("vit_mnist.speed.choose.has_native_bf16", lambda on_cuda: False)
    pairs, skipped = candidates(CPU, "auto", "auto", include_compiled=False)
    assert pairs == [(n, "32-true") for n in ("reference", "fused", "handwritten")]
    assert skipped["native"].startswith("needs AVX2 or AVX-512")
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
    assert out.startswith("default False needs AVX2 or AVX-512"), out


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
    """The written-out backward against finite differences, on the inputs the module
    passes: the packed projection (B, T, 3*h*d_k), or for a single CLS query the queries
    (B, 1, h*d_k) and the keys and values (B, T, 2*h*d_k)."""
    g = torch.Generator().manual_seed(0)
    heads, head_dim, tokens = 3, 4, 7

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True)

    width = heads * head_dim
    if t_q == tokens:
        inputs = (rand(2, tokens, 3 * width), None)
    else:
        inputs = (rand(2, t_q, width), rand(2, tokens, 2 * width))
    assert torch.autograd.gradcheck(
        lambda q_src, kv_src: ExplicitAttention.apply(q_src, kv_src, heads, 0.5, causal), inputs
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
    args = dict(model_args=TINY, device=CPU, batch_size=8, allocator="system")
    pairs = choose_mod.candidates(CPU, "auto", "auto", False)[0]
    key = choose_mod._cache_key(CPU, TINY, 8, pairs)
    no_candidate = {key: {"path": "warp"}}  # an entry under the right key
    not_numbers = {key: {"images_per_s": {f"{p} {q}": True for p, q in pairs}}}
    for damage in ("[1, 2]", "not json", json.dumps(no_candidate), json.dumps(not_numbers)):
        (tmp_path / "speed_choices.json").write_text(damage)
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


def _fake_timing(speeds: dict[str, float], calls: list):
    """A stand-in for time_candidates: the given images/s, and 40 s first steps for the
    compiled paths (their compile)."""

    def time_candidates(net, pairs, **kwargs):
        calls.append([f"{p} {q}" for p, q in pairs])
        names = [f"{p} {q}" for p, q in pairs]
        first = {n: 40.0 if PATHS[n.split(" ")[0]].compiles else 0.1 for n in names}
        return choose_mod.Timing({n: speeds[n] for n in names}, first)

    return time_candidates


def test_auto_times_a_first_compile_only_when_the_training_time_pays_for_it(tmp_path, monkeypatch):
    monkeypatch.setenv("VIT_MNIST_CACHE", str(tmp_path))
    monkeypatch.setattr("vit_mnist.speed.choose.has_native_bf16", lambda on_cuda: False)
    monkeypatch.setattr("vit_mnist.speed.native.isa_class", lambda: "ARM")  # no native
    speeds = {"reference 32-true": 900.0, "fused 32-true": 1000.0, "handwritten 32-true": 1100.0}
    speeds["compile 32-true"] = 1300.0
    calls: list = []
    monkeypatch.setattr(choose_mod, "time_candidates", _fake_timing(speeds, calls))
    net = VisionTransformer(patch_size=7, **TINY)
    args = dict(model_args=TINY, device=CPU, batch_size=100, allocator="system")
    # 110 steps of 100 images at 1 100 images/s: 10 s of training, 5% of it is 0.5 s,
    # far from a first compile (60 s): the eager paths only, and the reason logged.
    short = choose(net, **args, planned_steps=110)
    assert (short.path, calls) == ("handwritten", [list(speeds)[:3]])
    assert "compile_budget=0.05" in short.skipped["compile"]
    assert "; compile (32-true: compiling is expected" in short.describe(CPU)
    # A run of 13 200 steps (1 200 s; with the 10 s before, 5% is 60.5 s): compiled, timed
    # against the eager paths within 0.85x of the best, chosen, and its compile recorded.
    long = choose(net, **args, planned_steps=13_200)
    assert calls[1] == ["compile 32-true", "fused 32-true", "handwritten 32-true"]
    assert (long.path, long.how, long.compile_s) == (
        "compile",
        "measured",
        {"compile 32-true": 40.0},
    )
    record = choose_mod.compile_record(CPU, TINY)
    assert record.compile_s == {"compile 32-true": 40.0}
    assert record.trained_s == pytest.approx(1210, abs=1)
    # A second process of the same DDP run trains alongside: its seconds are not added.
    choose(net, **args, planned_steps=13_200, count_training=False)
    assert choose_mod.compile_record(CPU, TINY).trained_s == pytest.approx(1210, abs=1)
    # From now on a short run finds the compiled answer in the cache, timing nothing.
    again = choose(net, **args, planned_steps=110)
    assert (again.path, again.how, len(calls)) == ("compile", "cached", 2)
    # false never times it; true always does (one more timing: a new candidate list).
    assert choose(net, **args, include_compiled=False, planned_steps=10**6).path == "handwritten"
    forced = choose(net, **{**args, "batch_size": 50}, include_compiled=True, planned_steps=0)
    assert forced.path == "compile"


def test_compiled_paths_are_not_timed_at_a_precision_that_runs_slower():
    record = choose_mod.CompileRecord({}, {}, 0.0)
    skipped: dict[str, str] = {}
    eager = {"handwritten 32-true": 1000.0, "handwritten bf16-mixed": 95.0}
    chosen = choose_mod._compiled_to_time(
        [("compile", "32-true"), ("compile", "bf16-mixed")],
        eager,
        include_compiled=True,
        record=record,
        run_s=0.0,
        compile_budget=0.05,
        skipped=skipped,
    )
    assert chosen == [("compile", "32-true")] and skipped == {}


def test_the_compile_record_keeps_the_longest_first_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("VIT_MNIST_CACHE", str(tmp_path))
    other = {**TINY, "embed_dim": 64}
    pair = ("compile", "32-true")
    assert choose_mod.compile_record(CPU, TINY).expected_s(pair) == choose_mod.FIRST_COMPILE_GUESS_S
    choose_mod.record_compile(CPU, TINY, pair, 90.0)  # a cold first compile
    choose_mod.record_compile(CPU, TINY, pair, 3.0)  # the same model again: warm
    choose_mod.record_compile(CPU, other, pair, 4.0)  # first here, but warm in inductor's cache
    assert choose_mod.compile_record(CPU, TINY).expected_s(pair) == 3.0
    assert choose_mod.compile_record(CPU, {**TINY, "depth": 3}).expected_s(pair) == 90.0
    (tmp_path / "compile_times.json").write_text('{"x": [1], "y": 5}')
    assert choose_mod.compile_record(CPU, TINY).expected_s(pair) == choose_mod.FIRST_COMPILE_GUESS_S
    choose_mod.record_compile(CPU, TINY, pair, 2.0)  # a damaged file is written afresh
    assert choose_mod.compile_record(CPU, TINY).compile_s == {"compile 32-true": 2.0}


def _counted_path(name: str, steps: dict[str, int], delay_s: float = 0.0):
    """The reference path under ``name``, each forward counted in ``steps[name]`` and
    lengthened by ``delay_s`` seconds: a path whose speed a test sets."""
    import dataclasses

    def build(net):
        def forward(x):
            steps[name] = steps.get(name, 0) + 1
            time.sleep(delay_s)
            return net(x)

        return forward

    return dataclasses.replace(PATHS["reference"], name=name, build=build)


def test_timing_drops_a_clearly_slower_candidate_after_one_round(monkeypatch):
    steps = {"reference": 0, "slow": 0}
    paths = {
        "reference": _counted_path("reference", steps),
        "slow": _counted_path("slow", steps, 0.05),
    }
    monkeypatch.setattr(choose_mod, "PATHS", paths)
    net = VisionTransformer(patch_size=14, embed_dim=16, depth=1, num_heads=2)
    pairs = [("reference", "32-true"), ("slow", "32-true")]
    timing = choose_mod.time_candidates(
        net, pairs, device=CPU, batch_size=4, rounds=5, steps=2, min_round_s=0.0
    )
    assert timing.images_per_s["slow 32-true"] < 0.85 * timing.images_per_s["reference 32-true"]
    # One first step and one round of two for each, then the slow one is out and the
    # reference alone is left: nothing more to compare.
    assert steps == {"reference": 3, "slow": 3}
    assert set(timing.first_step_s) == {"reference 32-true", "slow 32-true"}


def test_a_race_the_planned_rounds_did_not_decide_is_timed_on(monkeypatch):
    steps = {"reference": 0, "twin": 0}
    paths = {name: _counted_path(name, steps) for name in steps}  # the same speed
    monkeypatch.setattr(choose_mod, "PATHS", paths)
    net = VisionTransformer(patch_size=14, embed_dim=16, depth=1, num_heads=2)
    pairs = [("reference", "32-true"), ("twin", "32-true")]

    def timed(close: float) -> dict[str, int]:
        steps.update(reference=0, twin=0)
        # keep=0: neither twin is dropped as clearly slower on a moment of load; `close` alone
        # decides.
        choose_mod.time_candidates(
            net,
            pairs,
            device=CPU,
            batch_size=4,
            rounds=2,
            steps=1,
            min_round_s=0,
            keep=0.0,
            close=close,
        )
        return dict(steps)

    # Every runner-up counts as close: the race goes on to three times the planned rounds
    # (the first step, then six rounds of one step each).
    assert timed(close=0.0001) == {"reference": 7, "twin": 7}
    # Only an exact tie counts as close: the planned two rounds decide it.
    assert timed(close=1.0) == {"reference": 3, "twin": 3}


def _timing_by_malloc_mode(speeds: dict[str, float], timed: list):
    """A stand-in for time_candidates whose images/s depend on the malloc mode set."""

    def time_candidates(net, pairs, **kwargs):
        timed.append((malloc.current_mode(), list(pairs)))
        return choose_mod.Timing({f"{p} {q}": speeds[malloc.current_mode()] for p, q in pairs}, {})

    return time_candidates


def test_auto_keeps_freed_memory_only_where_it_measures_faster(
    tmp_path, monkeypatch, mallopt_calls
):
    monkeypatch.setenv("VIT_MNIST_CACHE", str(tmp_path))
    monkeypatch.setattr(malloc, "unavailable", lambda: None)
    timed: list = []
    fake = _timing_by_malloc_mode({"system": 1000.0, "retain": 1200.0}, timed)
    monkeypatch.setattr(choose_mod, "time_candidates", fake)
    net = VisionTransformer(patch_size=7, **TINY)
    args = dict(model_args=TINY, device=CPU, path="fused", precision="32-true")
    first = choose(net, **args, batch_size=8)
    # glibc as it is first (there is no way back to it), then retain, on the forced path.
    assert timed == [("system", [("fused", "32-true")]), ("retain", [("fused", "32-true")])]
    assert (first.allocator, first.allocator_how) == ("retain", "measured")
    assert first.allocator_images_per_s == {"system": 1000.0, "retain": 1200.0}
    assert mallopt_calls == [malloc.RETAIN, malloc.RETAIN] and malloc.current_mode() == "retain"
    assert "malloc: retain (measured; images/s: system 1,000, retain 1,200); chosen in" in (
        first.describe(CPU)
    )
    # The next run with the same settings reads it, timing nothing.
    again = choose(net, **args, batch_size=8)
    assert (again.allocator, again.allocator_how, len(timed)) == ("retain", "cached", 2)
    # A damaged figure in the cache is left out of the log, not formatted.
    file = tmp_path / "speed_choices.json"
    file.write_text(file.read_text().replace("1200.0", '"x"'))
    damaged = choose(net, **args, batch_size=8)
    assert damaged.allocator_images_per_s == {"system": 1000.0} and "system 1,000)" in (
        damaged.describe(CPU)
    )
    # Where retain is slower it is not kept: glibc's thresholds go back to their ceiling.
    monkeypatch.setattr(
        choose_mod,
        "time_candidates",
        _timing_by_malloc_mode({"system": 1000.0, "retain": 990.0}, []),
    )
    slower = choose(net, **args, batch_size=16)
    assert (slower.allocator, malloc.current_mode()) == ("system", "system")
    assert mallopt_calls[-1] == malloc.CEILING
    # auto on the GPU, or without glibc, sets nothing and says why.
    monkeypatch.setattr(malloc, "unavailable", lambda: "needs Linux with glibc; this is Darwin")
    mallopt_calls.clear()
    other = choose(net, **args, batch_size=32)
    assert other.allocator_how == "not timed: needs Linux with glibc; this is Darwin"
    assert mallopt_calls == []


def test_auto_times_the_paths_under_the_malloc_mode_it_keeps(tmp_path, monkeypatch, mallopt_calls):
    monkeypatch.setenv("VIT_MNIST_CACHE", str(tmp_path))
    monkeypatch.setattr(malloc, "unavailable", lambda: None)
    monkeypatch.setattr("vit_mnist.speed.choose.has_native_bf16", lambda on_cuda: False)
    timed: list = []
    # retain speeds handwritten up, and fused most, so fused wins under it; but fused alone
    # runs faster still under glibc's own malloc.
    speeds = {"system": {"fused": 1300.0}, "retain": {"handwritten": 1200.0, "fused": 1250.0}}

    def time_candidates(net, pairs, **kwargs):
        mode = malloc.current_mode()
        timed.append((mode, list(pairs)))
        return choose_mod.Timing({f"{p} {q}": speeds[mode].get(p, 1000.0) for p, q in pairs}, {})

    monkeypatch.setattr(choose_mod, "time_candidates", time_candidates)
    net = VisionTransformer(patch_size=7, **TINY)
    choice = choose(net, model_args=TINY, device=CPU, batch_size=8, include_compiled=False)
    probe, chosen = [("handwritten", "32-true")], [("fused", "32-true")]
    eager, _ = candidates(CPU, "auto", "32-true", include_compiled=False)
    # The mode first, on handwritten; then every path under the mode it kept; then, as
    # another path won, the mode again on that path, whose answer the run keeps.
    assert timed == [
        ("system", probe),
        ("retain", probe),
        ("retain", eager),
        ("system", chosen),
        ("retain", chosen),
    ]
    assert (choice.path, choice.how) == ("fused", "measured")
    assert (choice.allocator, choice.allocator_how) == ("system", "measured")
    assert choice.allocator_images_per_s == {"system": 1300.0, "retain": 1250.0}
    assert malloc.current_mode() == "system" and mallopt_calls[-1] == malloc.CEILING
    # Run again: all three answers come from the cache, and the mode is set as before.
    timed.clear()
    cached = choose(net, model_args=TINY, device=CPU, batch_size=8, include_compiled=False)
    assert timed == []
    assert (cached.path, cached.how, cached.allocator, cached.allocator_how) == (
        "fused",
        "cached",
        "system",
        "cached",
    )
    # Figures timed under one mode are not read under the other: the paths are timed again.
    again = choose(
        net, model_args=TINY, device=CPU, batch_size=8, include_compiled=False, allocator="system"
    )
    assert (again.how, timed[-1]) == ("measured", ("system", eager))


@pytest.mark.parametrize(
    ("pair", "stand_in"),
    [
        (("compile", "32-true"), ("handwritten", "32-true")),
        (("compile_native", "bf16-mixed"), ("native", "bf16-mixed")),
        (("fused", "bf16-mixed"), ("fused", "bf16-mixed")),
    ],
)
def test_malloc_is_timed_on_a_compiled_paths_eager_counterpart(pair, stand_in):
    assert choose_mod.eager_counterpart(pair) == stand_in
    assert not PATHS[stand_in[0]].compiles


def test_every_compiled_path_names_an_eager_counterpart_and_no_eager_path_does():
    for name, path in PATHS.items():
        if path.compiles:
            assert path.eager in PATHS and not PATHS[path.eager].compiles, name
        else:
            assert path.eager is None, name


def test_forced_and_unknown_allocator_modes(monkeypatch, mallopt_calls):
    monkeypatch.setattr(choose_mod, "time_candidates", lambda *a, **k: pytest.fail("timed"))
    net = VisionTransformer(patch_size=7, **TINY)
    args = dict(model_args=TINY, device=CPU, batch_size=8, path="fused", precision="32-true")
    assert choose(net, **args, allocator="retain").allocator_how == "forced"
    assert mallopt_calls == [malloc.RETAIN]
    with pytest.raises(ConfigError, match=r"speed.allocator='lots' is unknown; use auto or one"):
        choose(net, **args, allocator="lots")
    monkeypatch.setattr(malloc, "unavailable", lambda: "needs Linux with glibc; this is Darwin")
    with pytest.raises(ConfigError, match="speed.allocator=retain cannot be set here: needs Linux"):
        choose(net, **args, allocator="retain")


def test_a_single_candidate_is_timed_over_every_round(monkeypatch):
    steps: dict[str, int] = {}
    monkeypatch.setattr(choose_mod, "PATHS", {"reference": _counted_path("reference", steps)})
    net = VisionTransformer(patch_size=14, embed_dim=16, depth=1, num_heads=2)
    choose_mod.time_candidates(
        net, [("reference", "32-true")], device=CPU, batch_size=4, rounds=3, steps=2, min_round_s=0
    )
    assert steps["reference"] == 1 + 3 * 2  # the first step, then three rounds of two


def test_short_steps_are_timed_in_rounds_of_min_round_s(monkeypatch):
    steps: dict[str, int] = {}
    # A 20 ms step, as a GPU's.
    monkeypatch.setattr(choose_mod, "PATHS", {"reference": _counted_path("reference", steps, 0.02)})
    net = VisionTransformer(patch_size=14, embed_dim=16, depth=1, num_heads=2)
    pair = ("reference", "32-true")
    timing = choose_mod.time_candidates(
        net, [pair], device=CPU, batch_size=4, rounds=2, steps=2, min_round_s=0.1
    )
    # The first step, then rounds of about 0.1 s: at most 5 steps of 20 ms and more; the
    # second round's at least 4, sized by the first round's measured steps.
    assert 1 + 2 + 4 <= steps["reference"] <= 1 + 2 * 5
    assert timing.images_per_s["reference 32-true"] < 4 / 0.02


@pytest.mark.skipif(malloc.unavailable() is not None, reason="needs Linux with glibc")
def test_mallopt_takes_the_retain_and_ceiling_settings():
    # In a process of its own: the setting is the whole process's and cannot be undone.
    code = (
        "from vit_mnist.speed import allocator as a; a.set_mode('retain'); "
        "a.set_mode('system'); a.set_mode('retain'); print(a.current_mode())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (done.returncode, done.stdout.strip()) == (0, "retain"), done.stderr
