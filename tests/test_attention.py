"""MultiHeadSelfAttention against the textbook definition."""

from __future__ import annotations

import math

import pytest
import torch

from vit_mnist.errors import ConfigError
from vit_mnist.models.attention import MultiHeadSelfAttention


def textbook_mha(attn: MultiHeadSelfAttention, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """Per head i: softmax(X W_i^Q (X W_i^K)^T / sqrt(d_k)) X W_i^V, concat, W^O.

    ``qkv`` holds W^Q, W^K and W^V one after the other, each h * d_k rows, head i's d_k
    rows at i * d_k (h * d_k is embed_dim unless ``head_dim`` was given)."""
    h, dk = attn.num_heads, attn.head_dim
    d = h * dk
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


def test_impossible_split_into_heads_raises_value_error_naming_values():
    # The split of the width into heads is the layer's own check; each value's range
    # (embed_dim >= 1, attention_impl one of ...) is the settings schema's, checked with the
    # config (tests/test_vit.py: check_model_args).
    with pytest.raises(ConfigError) as info:
        MultiHeadSelfAttention(embed_dim=64, num_heads=3)
    for word in ("embed_dim=64", "num_heads=3", "[1, 2, 4, 8, 16, 32, 64]"):
        assert word in str(info.value)


def test_auto_is_the_explicit_path():
    # Checkpoints of earlier versions stored attention_impl="auto": it runs the textbook.
    torch.manual_seed(0)
    auto = MultiHeadSelfAttention(embed_dim=32, num_heads=4, impl="auto")
    explicit = MultiHeadSelfAttention(embed_dim=32, num_heads=4, impl="explicit")
    explicit.load_state_dict(auto.state_dict())
    x = torch.randn(2, 17, 32)
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


def test_attention_dropout_in_training_drops_weights():
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(embed_dim=16, num_heads=2, attn_dropout=0.5).train()
    x = torch.randn(2, 9, 16)
    assert not torch.equal(attn(x), attn(x))  # a fresh dropout mask per call
    attn.eval()
    torch.testing.assert_close(attn(x), attn(x, need_weights=True)[0])
