"""The speed layer: every path gives the reference model's values and gradients, and
``auto`` chooses by measurement, caches, and never touches the model it times."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import assert_same_values_and_gradients, count_applies, record_compiles
from vit_mnist.errors import ConfigError
from vit_mnist.models.attention import MultiHeadSelfAttention
from vit_mnist.models.vit import VisionTransformer
from vit_mnist.settings import PATH_NAMES
from vit_mnist.speed import choose as choose_mod
from vit_mnist.speed.choose import PATHS, Choice, candidates, choose, prepare_speed
from vit_mnist.speed.forward import (
    ExplicitAttention,
    add_norm,
    attention_forward,
    handwritten_backward_core,
    reference_core,
    sdpa_core,
    vit_forward,
)

# Depends on the CPU's instruction set: CI runs it again under AVX2 emulation (.ci/run).
pytestmark = pytest.mark.isa

CPU = torch.device("cpu")
TINY = dict(embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0)
# The smallest model with every layer kind (a full block and the CLS-only last block),
# for the paths that compile: compiling takes seconds per graph node.
SMALLEST = dict(embed_dim=16, depth=2, num_heads=2, mlp_ratio=2.0)
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


def _assert_same(
    name: str,
    causal: bool,
    patch_size: int,
    bf16: bool = False,
    device: torch.device = CPU,
    model: dict = TINY,
    batch: int = 3,
) -> None:
    torch.manual_seed(0)
    net = VisionTransformer(patch_size=patch_size, causal=causal, **model).to(device)
    x = torch.randn(batch, 1, 28, 28, device=device)
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


@pytest.mark.parametrize("name", EAGER)
def test_eager_paths_give_a_distilled_vits_two_heads_and_their_gradients(name):
    """DeiT's distillation token: its row is kept through the last block like the CLS
    token's, and ``heads=True`` gives both heads' logits, as the distillation loss needs."""
    _skip_unavailable(name)
    torch.manual_seed(0)
    net = VisionTransformer(patch_size=7, distillation=True, **TINY)
    x = torch.randn(3, 1, 28, 28)

    def both(forward):
        return lambda images: torch.cat(forward(images, heads=True), dim=-1)

    ref, ref_grads = _grads(net, both(PATHS["reference"].build(net)), x)
    out, grads = _grads(net, both(PATHS[name].build(net)), x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    for key in ref_grads:  # the distillation token and head included
        torch.testing.assert_close(grads[key], ref_grads[key], atol=1e-5, rtol=1e-4, msg=key)
    with torch.no_grad():  # one output: the two heads' softmax averaged, as net(x)
        torch.testing.assert_close(PATHS[name].build(net)(x), net(x), atol=1e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILED)
def test_compiled_paths_give_the_reference_values_and_gradients(name, monkeypatch):
    _skip_unavailable(name)
    # What this checks is the path's graph: what dynamo traces of vit_forward (dynamic
    # shapes, floats as constants) and AOT autograd's forward and backward graphs of it, on
    # the model's own parameters. The "aot_eager" backend runs those graphs as inductor
    # receives them, without inductor's C++ code generation (PyTorch's, tested there): on
    # 2 AVX2 cores with empty caches that compile took 46 to 57 s of the suite's 5 minutes,
    # this 12.
    compiled = record_compiles(monkeypatch, "aot_eager")
    _assert_same(name, causal=False, patch_size=14, model=SMALLEST, batch=2)
    assert compiled == [{"dynamic": True, "mode": None}]  # one graph, at the training step


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


@pytest.mark.parametrize("device, mode", [("cpu", None), ("cuda", "reduce-overhead")])
def test_the_compiled_step_uses_cuda_graphs_on_cuda_only(device, mode, monkeypatch):
    """On CUDA the compiled path is the ecosystem's CUDA-graph path; on a CPU, inductor's
    default (a CPU has no graphs to replay)."""
    asked = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: asked.append(kwargs) or fn)
    step = choose_mod.compile_step(lambda x: x + 1, torch.device(device))
    assert asked == [{"dynamic": True, "mode": mode}] and step(1) == 2


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


@pytest.mark.parametrize("bf16", [False, True])
def test_residual_adds_keep_the_reference_stream(bf16):
    """The residual add: the reference's values, and under bf16 autocast the stream stays
    float32 as in the reference (a bf16 branch must not take the sum); then each eager
    forward, whose blocks run on these adds, gives the model's."""
    torch.manual_seed(0)
    net = VisionTransformer(patch_size=7, **TINY)
    x, norm = torch.randn(2, 17, TINY["embed_dim"]), net.blocks[0].norm1
    branch = torch.randn_like(x).to(torch.bfloat16 if bf16 else torch.float32)
    ref = x + branch
    s, h = add_norm(x, branch, norm)
    assert s.dtype == torch.float32
    torch.testing.assert_close(s, ref)
    torch.testing.assert_close(h, norm(ref))
    images = torch.randn(2, 1, 28, 28)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for core in (reference_core, handwritten_backward_core, sdpa_core):
            out = vit_forward(net, images, core)
            torch.testing.assert_close(out, net(images), atol=2e-2 if bf16 else 1e-5, rtol=1e-4)


def test_forced_path_is_not_timed(monkeypatch):
    monkeypatch.setattr(choose_mod, "time_candidates", lambda *a, **k: pytest.fail("timed"))
    net = VisionTransformer(patch_size=7, **TINY)
    choice = choose(
        net,
        device=CPU,
        batch_size=8,
        path="fused",
        precision="32-true",
    )
    assert (choice.path, choice.precision, choice.how) == ("fused", "32-true", "forced")


def test_unavailable_paths_are_refused(monkeypatch):
    assert list(PATHS) == list(PATH_NAMES)  # the settings schema's choices (tests/test_train.py)
    monkeypatch.setattr("vit_mnist.speed.native.isa_class", lambda: "ARM")
    with pytest.raises(ConfigError, match="speed.path=native cannot run here: needs AVX2 or AVX-"):
        candidates(CPU, "native", "32-true", False)


def test_auto_leaves_out_what_cannot_run_or_compiles(monkeypatch):
    monkeypatch.setattr("vit_mnist.speed.native.isa_class", lambda: "ARM")
    monkeypatch.setattr("vit_mnist.speed.choose.has_native_bf16", lambda on_cuda: False)
    pairs, skipped = candidates(CPU, "auto", "auto", include_compiled=False)
    assert pairs == [(n, "32-true") for n in ("reference", "fused", "handwritten")]
    assert skipped["native"].startswith("needs AVX2 or AVX-512")
    assert "speed.compile=true" in skipped["compile"]
    monkeypatch.setattr("vit_mnist.speed.choose.has_native_bf16", lambda on_cuda: True)
    pairs, _ = candidates(CPU, "handwritten", "auto", include_compiled=False)
    assert pairs == [("handwritten", "32-true"), ("handwritten", "bf16-mixed")]


def test_auto_measures_and_picks_the_fastest(monkeypatch, one_round_auto):
    monkeypatch.setattr("vit_mnist.speed.choose.has_native_bf16", lambda on_cuda: False)
    # Real timing (one_round_auto). No native paths: their kernels would be built afresh
    # into this test's cache folder.
    monkeypatch.setattr("vit_mnist.speed.native.isa_class", lambda: "ARM")
    torch.manual_seed(0)
    net = VisionTransformer(patch_size=7, **TINY)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    rng = torch.get_rng_state()
    first = choose(net, device=CPU, batch_size=16)
    assert first.how == "measured" and "measured now in" in first.describe(CPU)
    assert first.images_per_s[f"{first.path} {first.precision}"] == max(first.images_per_s.values())
    assert set(first.images_per_s) >= {"reference 32-true", "fused 32-true"}
    # The timing ran on a copy and put the random-number state back.
    assert all(torch.equal(state[k], v) for k, v in net.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


def test_isa_class_follows_aten_cpu_capability(monkeypatch):
    # In a process of its own (PyTorch reads the variable at start-up), importing no more
    # than the class needs: torch alone, not the models' torchvision.
    code = "from vit_mnist.hardware import isa_class, has_native_bf16;"
    code += "print(isa_class(), has_native_bf16(False))"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["default", "False"], out
    # What the native path then says, with that class.
    monkeypatch.setattr("vit_mnist.speed.native.isa_class", lambda: "default")
    why = PATHS["native"].unavailable(CPU)
    assert why == "needs AVX2 or AVX-512, this CPU runs PyTorch at default", why


@pytest.mark.parametrize("queries", [1, 2])  # the CLS token; and a distillation token
@pytest.mark.parametrize("qkv_bias", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("core", [reference_core, sdpa_core, handwritten_backward_core])
def test_cls_only_attention_is_the_first_rows_of_the_reference(core, causal, qkv_bias, queries):
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(embed_dim=24, num_heads=3, causal=causal, qkv_bias=qkv_bias)
    x = torch.randn(2, 7, 24, requires_grad=True)
    full, first = attn(x)[:, :queries], attention_forward(attn, x, core, queries)
    assert first.shape == (2, queries, 24)
    assert_same_values_and_gradients(first, full, [x, attn.qkv.weight], atol=1e-6, rtol=1e-5)
    if causal:  # the first tokens then see only themselves: the later ones cannot move them
        (grad_x,) = torch.autograd.grad(attention_forward(attn, x, core, queries).sum(), [x])
        assert grad_x[:, queries:].abs().max() == 0


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


def _fake_timing(speeds: dict[str, float], calls: list):
    """A stand-in for time_candidates: the given images/s, and the pairs it was asked for."""

    def time_candidates(net, pairs, **kwargs):
        calls.append([f"{p} {q}" for p, q in pairs])
        return choose_mod.Timing({f"{p} {q}": speeds[f"{p} {q}"] for p, q in pairs})

    return time_candidates


def test_compiled_paths_are_timed_only_with_speed_compile(monkeypatch):
    monkeypatch.setattr("vit_mnist.speed.choose.has_native_bf16", lambda on_cuda: True)
    monkeypatch.setattr("vit_mnist.speed.native.isa_class", lambda: "ARM")  # no native
    eager = {"reference": 900.0, "fused": 1000.0, "handwritten": 1100.0}
    speeds = {f"{p} 32-true": v for p, v in eager.items()}
    speeds |= {f"{p} bf16-mixed": 2 * v for p, v in eager.items()}
    speeds |= {"compile 32-true": 9000.0, "compile bf16-mixed": 3000.0}
    calls: list = []
    monkeypatch.setattr(choose_mod, "time_candidates", _fake_timing(speeds, calls))
    net = VisionTransformer(patch_size=7, **TINY)
    args = dict(device=CPU, batch_size=100)
    # speed.compile=false (the default): the eager paths only, and the reason logged.
    plain = choose(net, **args)
    assert (plain.path, plain.precision) == ("handwritten", "bf16-mixed")
    assert len(calls) == 1 and not any(c.startswith("compile") for c in calls[0])
    assert "speed.compile=true" in plain.skipped["compile"]
    assert "not timed: compile (compiles first" in plain.describe(CPU)
    # true: the compiled path at one precision, bf16 where the hardware has it (one
    # compile, not one per precision, although 32-true would be faster here), timed in
    # the same rounds as the eager paths.
    compiled = choose(net, **args, include_compiled=True)
    assert sorted(calls[1]) == sorted([*speeds.keys() - {"compile 32-true"}])
    assert (compiled.path, compiled.precision) == ("compile", "bf16-mixed")
    assert compiled.how == "measured"
    assert compiled.images_per_s["compile bf16-mixed"] == 3000.0


def test_a_forced_compiled_path_with_precision_auto_compiles_once(monkeypatch):
    # At bf16 where the hardware computes it, with no timing: a compile per precision
    # would cost 30 to 60 s each.
    calls: list = []
    monkeypatch.setattr(choose_mod, "time_candidates", _fake_timing({}, calls))
    net = VisionTransformer(patch_size=7, **TINY)
    for bf16, precision in ((True, "bf16-mixed"), (False, "32-true")):
        monkeypatch.setattr(
            "vit_mnist.speed.choose.has_native_bf16", lambda on_cuda, bf16=bf16: bf16
        )
        choice = choose(net, device=CPU, batch_size=8, path="compile")
        assert (choice.path, choice.precision, choice.how) == ("compile", precision, "forced")
    assert calls == []


def _counted_path(name: str, steps: dict[str, int], delay_s: float | list[float] = 0.0):
    """The reference path under ``name``, each forward counted in ``steps[name]`` and
    lengthened by ``delay_s`` seconds (a list: one delay per forward, in turn): a path whose
    speed a test sets."""
    import dataclasses
    import itertools

    delays = iter(delay_s) if isinstance(delay_s, list) else itertools.repeat(delay_s)

    def build(net):
        def forward(x):
            steps[name] = steps.get(name, 0) + 1
            time.sleep(next(delays))
            return net(x)

        return forward

    return dataclasses.replace(PATHS["reference"], build=build)


def test_timing_interleaves_every_candidate_over_every_round(monkeypatch):
    steps = {"a": 0, "b": 0}
    paths = {name: _counted_path(name, steps, 0.002) for name in steps}
    monkeypatch.setattr(choose_mod, "PATHS", paths)
    net = VisionTransformer(patch_size=14, embed_dim=16, depth=1, num_heads=2)
    pairs = [("a", "32-true"), ("b", "32-true")]
    timing = choose_mod.time_candidates(
        net, pairs, device=CPU, batch_size=4, rounds=3, steps=2, min_round_s=0.0, budget_s=1e9
    )
    # One untimed first step each, two untimed rounds, then three rounds of two steps each.
    assert steps == {"a": 11, "b": 11} and timing.rounds == 3 and not timing.dropped


def test_a_candidate_that_cannot_win_is_dropped_early(monkeypatch):
    steps = {"reference": 0, "slow": 0}
    paths = {
        "reference": _counted_path("reference", steps),
        "slow": _counted_path("slow", steps, 0.1),
    }
    monkeypatch.setattr(choose_mod, "PATHS", paths)
    net = VisionTransformer(patch_size=14, embed_dim=16, depth=1, num_heads=2)
    pairs = [("reference", "32-true"), ("slow", "32-true")]
    timing = choose_mod.time_candidates(
        net, pairs, device=CPU, batch_size=4, rounds=5, steps=2, min_round_s=0.0, budget_s=1e9
    )
    # A step of the slow path sleeps 0.1 s: no round of it can beat 4 images / 0.1 s.
    assert 0 < timing.figures["slow 32-true"] <= 4 / 0.1
    assert timing.figures["reference 32-true"] > 4 / 0.1
    # Dropped after two timed rounds, which leaves one candidate: the timing ends there.
    assert timing.dropped == ["slow 32-true"]
    assert steps == {"reference": 1 + 2 * 2 + 2 * 2, "slow": 1 + 2 * 2 + 2 * 2}


def test_a_candidate_counts_with_its_median_round_not_a_lucky_one(monkeypatch):
    """One fast round among slow ones (a quiet moment on a shared machine) does not set the
    figure: the loop that follows runs at the typical round's speed."""
    # The untimed first step, then three rounds of one step.
    lucky = _counted_path("lucky", {}, [0.05, 0.002, 0.05, 0.05])
    monkeypatch.setattr(choose_mod, "PATHS", {"lucky": lucky})
    net = VisionTransformer(patch_size=14, embed_dim=16, depth=1, num_heads=2)
    speeds = choose_mod.time_candidates(
        net,
        [("lucky", "32-true")],
        device=CPU,
        batch_size=4,
        rounds=3,
        steps=1,
        min_round_s=0.0,
        budget_s=1e9,
        warmup_rounds=0,
    )
    # The lucky round alone ran at about 4 / 0.002 = 2,000 images/s; the others at 80.
    assert 0 < speeds.figures["lucky 32-true"] <= 4 / 0.05


def test_timing_pays_the_loops_augmentation_in_every_step(monkeypatch):
    """auto times what each step of the training loop pays: prepare_speed hands the
    datamodule's batch augmentation to the timing, which runs it before every step."""
    from omegaconf import OmegaConf

    from vit_mnist.data.synthetic import SyntheticDataModule
    from vit_mnist.training.module import ViTClassifier

    steps = {"reference": 0, "slow": 0}
    paths = {
        "reference": _counted_path("reference", steps),
        "slow": _counted_path("slow", steps, 0.05),  # clear of a loaded machine's noise
    }
    monkeypatch.setattr(choose_mod, "PATHS", paths)
    datamodule = SyntheticDataModule(augment={"degrees": 10.0, "translate": 0.1})
    augment, seen = datamodule.augment, []
    datamodule.augment = lambda x: seen.append(x.shape) or augment(x)
    model = dict(patch_size=14, embed_dim=16, depth=1, num_heads=2)
    cfg = OmegaConf.create(
        {
            "speed": {"path": "auto", "compile": False},
            "trainer": {"accelerator": "cpu", "precision": "32-true"},
            "data": {"batch_size": 4},
            "model": model,
        }
    )
    choice = prepare_speed(ViTClassifier(model=model), cfg, datamodule)
    assert choice.how == "measured" and choice.path == "reference"
    assert len(seen) == sum(steps.values()) > 2 and set(seen) == {(4, 1, 28, 28)}


def test_under_cpu_ddp_each_process_times_its_steps_on_its_share_of_the_cores(monkeypatch, caplog):
    """Two DDP processes on a CPU each train on half the cores (Lightning sets it when fit
    starts): the speed choice times and names that, not the whole machine's threads."""
    import logging

    from omegaconf import OmegaConf

    from vit_mnist.tasks.train import prepare_ddp_launch
    from vit_mnist.training.module import ViTClassifier

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = dict(patch_size=14, embed_dim=16, depth=1, num_heads=2)
        cfg = OmegaConf.create(
            {
                "speed": {"path": "reference", "compile": False},
                "trainer": {
                    "accelerator": "cpu",
                    "strategy": "ddp",
                    "devices": 2,
                    "precision": "32-true",
                },
                "data": {"batch_size": 4},
                "model": model,
            }
        )
        with caplog.at_level(logging.INFO, logger="vit_mnist.speed.choose"):
            prepare_ddp_launch(cfg.trainer)  # as vit-mnist-train calls it, before train()
            prepare_speed(ViTClassifier(model=model), cfg)
        affinity = getattr(os, "sched_getaffinity", None)  # not on macOS
        share = max(1, (len(affinity(0)) if affinity else os.cpu_count() or 1) // 2)
        assert torch.get_num_threads() == share
        (line,) = [r.getMessage() for r in caplog.records if "speed path" in r.getMessage()]
        assert f"{share} thread" in line and "2 threads" not in line
    finally:
        torch.set_num_threads(threads)


def test_a_single_candidate_is_timed_over_every_round(monkeypatch):
    steps: dict[str, int] = {}
    monkeypatch.setattr(choose_mod, "PATHS", {"reference": _counted_path("reference", steps)})
    net = VisionTransformer(patch_size=14, embed_dim=16, depth=1, num_heads=2)
    pair = ("reference", "32-true")
    choose_mod.time_candidates(
        net, [pair], device=CPU, batch_size=4, rounds=3, steps=2, min_round_s=0, budget_s=1e9
    )
    # The first step, two untimed rounds, then three rounds of two.
    assert steps["reference"] == 1 + 2 * 2 + 3 * 2


def _clocked_reference(monkeypatch, step_s: float) -> dict[str, int]:
    """The reference path as the only candidate, each step ``step_s`` seconds on a clock
    that only the steps move (so the machine's load cannot change the count); returns the
    step counts."""
    import dataclasses
    from types import SimpleNamespace

    steps: dict[str, int] = {}
    clock = [0.0]
    counted = _counted_path("reference", steps)

    def build(net):
        forward = counted.build(net)

        def step(x):
            clock[0] += step_s
            return forward(x)

        return step

    monkeypatch.setattr(
        choose_mod, "PATHS", {"reference": dataclasses.replace(counted, build=build)}
    )
    monkeypatch.setattr(choose_mod, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    return steps


def test_short_steps_are_timed_in_rounds_of_min_round_s(monkeypatch):
    """A 1/64 s step, as a GPU's: rounds of 1/8 s, not of 2 steps (binary fractions, so
    the clock's sums are exact)."""
    steps = _clocked_reference(monkeypatch, 1 / 64)
    net = VisionTransformer(patch_size=14, embed_dim=16, depth=1, num_heads=2)
    pair = ("reference", "32-true")
    speeds = choose_mod.time_candidates(
        net, [pair], device=CPU, batch_size=4, rounds=2, steps=2, min_round_s=1 / 8
    )
    # The first step, then two untimed and two timed rounds of (1/8) / (1/64) = 8 steps.
    assert steps["reference"] == 1 + 2 * 8 + 8 + 8
    assert speeds.figures["reference 32-true"] == pytest.approx(4 * 64)


def test_a_slow_step_stops_at_the_budget_and_says_so(monkeypatch):
    """A 2 s step (a big model on a busy 2-core CPU): the timing ends at its budget, within
    one pair's steps of it, and says it was cut short, rather than run its rounds over."""
    steps = _clocked_reference(monkeypatch, 2.0)
    net = VisionTransformer(patch_size=14, embed_dim=16, depth=1, num_heads=2)
    timing = choose_mod.time_candidates(
        net,
        [("reference", "32-true")],
        device=CPU,
        batch_size=4,
        rounds=5,
        min_rounds=3,
        steps=2,
        budget_s=6.0,
    )
    # The first step (2 s) and two untimed rounds of two steps (to 10 s): then over 6 s.
    assert steps["reference"] == 1 + 2 * 2
    assert timing.cut_short and not timing.agrees()
    assert timing.figures == {"reference 32-true": 4 / 2.0}


def test_a_candidate_slow_in_its_first_steps_is_timed_once_it_has_settled(monkeypatch):
    """A fresh process's first steps are slower than the loop's (the allocator still
    growing its heap: docs/speed.md, "How auto chooses"), and the first candidate pays most:
    the untimed rounds keep that from deciding, where timing from the first round would
    not."""
    for warmup_rounds, fastest in ((2, "settles"), (0, "steady")):
        paths = {
            "settles": _counted_path("settles", {}, [0.05] * 5 + [0.0] * 99),
            "steady": _counted_path("steady", {}, 0.01),
        }
        monkeypatch.setattr(choose_mod, "PATHS", paths)
        net = VisionTransformer(patch_size=14, embed_dim=16, depth=1, num_heads=2)
        speeds = choose_mod.time_candidates(
            net,
            [("settles", "32-true"), ("steady", "32-true")],
            device=CPU,
            batch_size=4,
            rounds=3,
            steps=2,
            min_round_s=0.0,
            budget_s=1e9,
            warmup_rounds=warmup_rounds,
        )
        figures = speeds.figures
        assert max(figures, key=figures.get) == f"{fastest} 32-true", (warmup_rounds, figures)


def test_prepare_speed_sets_the_step_and_leaves_the_checkpoint_keys_alone():
    """The speed layer sets one plain attribute of the LightningModule: the state dict (so
    every checkpoint) holds the same keys on every path, net.* and no copy under another
    name."""
    from omegaconf import OmegaConf

    from vit_mnist.training.module import ViTClassifier

    model = dict(patch_size=7, **TINY)
    module = ViTClassifier(model=model)
    keys = set(module.state_dict())
    assert all(k.startswith("net.") for k in keys)
    for name in EAGER:
        if PATHS[name].unavailable(CPU):
            continue
        cfg = OmegaConf.create(
            {
                "speed": {"path": name, "compile": False},
                "trainer": {"accelerator": "cpu", "precision": "32-true"},
                "data": {"batch_size": 4},
                "model": model,
            }
        )
        choice = prepare_speed(module, cfg)
        assert isinstance(choice, Choice) and choice.path == name
        assert set(module.state_dict()) == keys
        x = torch.randn(2, 1, 28, 28)
        torch.testing.assert_close(module.step_forward(x), module.net(x), atol=1e-5, rtol=1e-4)
