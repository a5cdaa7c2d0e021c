"""MultiHeadSelfAttention against the textbook definition."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import assert_same_values_and_gradients
from vit_mnist.errors import ConfigError
from vit_mnist.models.attention import MultiHeadSelfAttention


def textbook_mha(attn: MultiHeadSelfAttention, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """Per head i: softmax(X W_i^Q (X W_i^K)^T / sqrt(d_k)) X W_i^V, concat, W^O."""
    d, h = attn.embed_dim, attn.num_heads
    dk = d // h
    w, b = attn.qkv.weight, attn.qkv.bias
    heads = []
    for i in range(h):

        def proj(j: int, i: int = i) -> torch.Tensor:
            rows = slice(j * d + i * dk, j * d + (i + 1) * dk)
            return x @ w[rows].T + (0.0 if b is None else b[rows])

        q, k, v = proj(0), proj(1), proj(2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(dk)
        if causal:
            t = x.shape[1]
            scores = scores.masked_fill(
                torch.triu(torch.ones(t, t, dtype=torch.bool), 1), -math.inf
            )
        heads.append(torch.softmax(scores, dim=-1) @ v)
    return attn.proj(torch.cat(heads, dim=-1))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("impl", ["explicit", "fused"])
def test_matches_textbook_definition(impl, causal):
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(embed_dim=24, num_heads=3, causal=causal, impl=impl).eval()
    x = torch.randn(2, 7, 24)
    torch.testing.assert_close(attn(x), textbook_mha(attn, x, causal), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qkv_bias", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("impl", ["explicit", "fused"])
def test_forward_cls_is_the_first_row_of_forward(impl, causal, qkv_bias):
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(
        embed_dim=24, num_heads=3, causal=causal, impl=impl, qkv_bias=qkv_bias
    )
    x = torch.randn(2, 7, 24, requires_grad=True)
    full, cls = attn(x)[:, :1], attn.forward_cls(x)
    assert cls.shape == (2, 1, 24)
    torch.testing.assert_close(cls, textbook_mha(attn, x, causal)[:, :1], atol=1e-5, rtol=1e-5)
    assert_same_values_and_gradients(cls, full, [x, attn.qkv.weight], atol=1e-6, rtol=1e-5)
    if causal:  # the CLS token then sees only itself: the other tokens cannot move it
        (grad_x,) = torch.autograd.grad(attn.forward_cls(x).sum(), [x])
        assert grad_x[:, 1:].abs().max() == 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_heads", [1, 2, 4, 8])
def test_explicit_and_fused_agree_in_float32(num_heads, causal):
    torch.manual_seed(1)
    explicit = MultiHeadSelfAttention(embed_dim=32, num_heads=num_heads, causal=causal)
    fused = MultiHeadSelfAttention(embed_dim=32, num_heads=num_heads, causal=causal, impl="fused")
    fused.load_state_dict(explicit.state_dict())
    x = torch.randn(3, 50, 32)
    out_e, out_f = explicit(x), fused(x)
    assert (out_e - out_f).abs().max().item() < 1e-5
    # Gradients agree too: the fused path is a drop-in for training.
    out_e.square().sum().backward()
    out_f.square().sum().backward()
    torch.testing.assert_close(
        explicit.qkv.weight.grad, fused.qkv.weight.grad, atol=1e-5, rtol=1e-4
    )


@pytest.mark.parametrize("impl", ["explicit", "fused"])
def test_weights_shape_rows_sum_to_one(impl):
    attn = MultiHeadSelfAttention(embed_dim=16, num_heads=4, impl=impl)
    out, weights = attn(torch.randn(5, 9, 16), need_weights=True)
    assert out.shape == (5, 9, 16)
    assert weights.shape == (5, 4, 9, 9)  # (batch, heads, tokens, tokens)
    assert (weights >= 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(5, 4, 9))


def test_fused_model_still_returns_weights_equal_to_explicit():
    # timm's trap: weights silently missing when the fused path is on.
    explicit = MultiHeadSelfAttention(embed_dim=16, num_heads=2)
    fused = MultiHeadSelfAttention(embed_dim=16, num_heads=2, impl="fused")
    fused.load_state_dict(explicit.state_dict())
    x = torch.randn(2, 6, 16)
    _, w_e = explicit(x, need_weights=True)
    _, w_f = fused(x, need_weights=True)
    torch.testing.assert_close(w_e, w_f)


def test_causal_mask_leaves_nothing_above_diagonal():
    attn = MultiHeadSelfAttention(embed_dim=16, num_heads=4, causal=True)
    _, weights = attn(torch.randn(2, 10, 16), need_weights=True)
    above = torch.triu(torch.ones(10, 10, dtype=torch.bool), 1)
    assert (weights[..., above] == 0).all()
    assert (weights[..., ~above] > 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 10))
    # The first token can only attend to itself.
    torch.testing.assert_close(weights[..., 0, 0], torch.ones(2, 4))


def test_bf16_autocast_runs_and_keeps_weights_normalised():
    attn = MultiHeadSelfAttention(embed_dim=32, num_heads=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, weights = attn(torch.randn(2, 8, 32), need_weights=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(weights.float().sum(-1), torch.ones(2, 4, 8), atol=1e-2, rtol=0)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"embed_dim": 64, "num_heads": 3}, ["embed_dim=64", "num_heads=3"]),
        ({"embed_dim": 0, "num_heads": 1}, ["embed_dim=0"]),
        ({"embed_dim": 8, "num_heads": -2}, ["num_heads=-2"]),
        ({"embed_dim": 8, "num_heads": 2, "impl": "flash"}, ["'flash'", "explicit", "fused"]),
    ],
)
def test_impossible_shapes_raise_value_error_naming_values(kwargs, words):
    with pytest.raises(ValueError) as info:
        MultiHeadSelfAttention(**kwargs)
    assert isinstance(info.value, ConfigError)
    for word in words:
        assert word in str(info.value)


def test_auto_runs_explicit_on_cpu_and_fused_on_cuda():
    from vit_mnist.models.attention import resolve_attention_impl

    assert resolve_attention_impl("auto", "cpu") == "explicit"
    assert resolve_attention_impl("auto", "cuda") == "fused"
    assert resolve_attention_impl("fused", "cpu") == "fused"
    torch.manual_seed(0)
    auto = MultiHeadSelfAttention(embed_dim=32, num_heads=4)
    explicit = MultiHeadSelfAttention(embed_dim=32, num_heads=4, impl="explicit")
    explicit.load_state_dict(auto.state_dict())
    x = torch.randn(2, 17, 32)
    # On the CPU, auto is the explicit path: the same numbers, bit for bit.
    assert torch.equal(auto(x), explicit(x))


def test_bf16_explicit_softmax_is_float32_and_matches_fused():
    torch.manual_seed(0)
    explicit = MultiHeadSelfAttention(embed_dim=64, num_heads=4, impl="explicit")
    fused = MultiHeadSelfAttention(embed_dim=64, num_heads=4, impl="fused")
    fused.load_state_dict(explicit.state_dict())
    x = torch.randn(4, 50, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, weights = explicit(x, need_weights=True)
        out_fused = fused(x)
    assert weights.dtype == torch.float32 and out.dtype == torch.bfloat16
    torch.testing.assert_close(weights.sum(-1), torch.ones(4, 4, 50))
    # Both round q, k, v and the weights to bf16 (8 significant bits): equal to a few ulp.
    torch.testing.assert_close(out.float(), out_fused.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), explicit(x), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t_q", [1, 7])
def test_explicit_training_path_backward_passes_gradcheck(t_q, causal):
    from vit_mnist.models.attention import _ExplicitAttention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, t_q, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 3, 7, 4, dtype=torch.float64, generator=g) for _ in range(2))
    k.requires_grad_(), v.requires_grad_()
    # Non-contiguous inputs, as the module passes them (views of the qkv projection).
    q_t, k_t, v_t = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: _ExplicitAttention.apply(q, k, v, 0.5, causal), (q_t, k_t, v_t)
    )


@pytest.mark.parametrize("causal", [False, True])
def test_explicit_training_path_matches_autograd_of_the_textbook_steps(causal, monkeypatch):
    from vit_mnist.models import attention

    calls = []
    apply = attention._ExplicitAttention.apply
    monkeypatch.setattr(
        attention._ExplicitAttention, "apply", lambda *a: calls.append(1) or apply(*a)
    )
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(embed_dim=32, num_heads=4, causal=causal)
    attn.native_kernel = False  # the PyTorch-operations Function (the kernel: its own tests)
    x = torch.randn(3, 50, 32, requires_grad=True)
    fast = attn(x)  # weights not asked for: the hand-written backward
    assert calls == [1]
    with torch.no_grad():
        attn(x)  # no backward to follow: the step-by-step path
    assert calls == [1]
    slow, _ = attn(x, need_weights=True)  # autograd through every step
    params = [x, attn.qkv.weight, attn.qkv.bias, attn.proj.weight]
    assert_same_values_and_gradients(fast, slow, params, atol=1e-5, rtol=1e-5)


def test_explicit_training_path_under_bf16_autocast_matches_float32():
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(embed_dim=64, num_heads=4)
    x = torch.randn(4, 50, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(x)
    assert out.dtype == torch.bfloat16
    (grad_bf16,) = torch.autograd.grad(out.float().square().sum(), [attn.qkv.weight])
    ref = attn(x)
    (grad_ref,) = torch.autograd.grad(ref.square().sum(), [attn.qkv.weight])
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    # bf16 keeps 8 significant bits: the weight gradient within a few percent of its scale.
    assert (grad_bf16 - grad_ref).abs().max() < 0.03 * grad_ref.abs().max()


def test_attention_dropout_in_training_drops_weights():
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(embed_dim=16, num_heads=2, attn_dropout=0.5).train()
    x = torch.randn(2, 9, 16)
    assert not torch.equal(attn(x), attn(x))  # a fresh dropout mask per call
    attn.eval()
    torch.testing.assert_close(attn(x), attn(x, need_weights=True)[0])
