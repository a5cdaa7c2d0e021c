"""The Vision Transformer: shapes, argument checks, gradients, learning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vit_mnist.errors import ConfigError
from vit_mnist.models import VisionTransformer, check_model_args

TINY = {"embed_dim": 32, "depth": 2, "num_heads": 4, "mlp_ratio": 2.0}


@pytest.mark.parametrize("patch_size", [1, 2, 4, 7, 14, 28])
def test_shapes(patch_size):
    model = VisionTransformer(patch_size=patch_size, **TINY)
    x = torch.randn(3, 1, 28, 28)
    tokens = model.forward_features(x)
    assert tokens.shape == (3, 1 + (28 // patch_size) ** 2, 32)
    assert model(x).shape == (3, 10)


@pytest.mark.parametrize("impl", ["explicit", "fused"])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_with_attention(impl, causal):
    model = VisionTransformer(patch_size=7, attention_impl=impl, causal=causal, **TINY).eval()
    x = torch.randn(2, 1, 28, 28)
    logits, weights = model.forward_with_attention(x)
    torch.testing.assert_close(logits, model(x), atol=1e-5, rtol=1e-5)
    assert len(weights) == 2
    for w in weights:
        assert w.shape == (2, 4, 17, 17)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 17))


def test_fused_and_explicit_models_agree():
    torch.manual_seed(0)
    explicit = VisionTransformer(patch_size=4, **TINY)
    fused = VisionTransformer(patch_size=4, attention_impl="fused", **TINY)
    fused.load_state_dict(explicit.state_dict())
    x = torch.randn(4, 1, 28, 28)
    assert (explicit(x) - fused(x)).abs().max().item() < 1e-5


@pytest.mark.parametrize("impl", ["explicit", "fused"])
def test_every_parameter_gets_a_finite_gradient(impl):
    torch.manual_seed(0)
    model = VisionTransformer(patch_size=7, attention_impl=impl, **TINY)
    loss = torch.nn.functional.cross_entropy(
        model(torch.randn(4, 1, 28, 28)), torch.tensor([0, 1, 2, 3])
    )
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
        assert p.grad.abs().sum() > 0, f"{name} has an all-zero gradient"


def test_overfits_one_small_batch():
    torch.manual_seed(0)
    model = VisionTransformer(patch_size=7, **TINY)
    x, y = torch.randn(32, 1, 28, 28), torch.arange(32) % 10
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    assert (model(x).argmax(-1) == y).all()


SHAPES = [  # combinations: the constructor checks them too
    ({"embed_dim": 64, "num_heads": 3}, ["embed_dim=64", "num_heads=3"]),
    ({"patch_size": 5}, ["patch_size=5", "img_size=28", "[1, 2, 4, 7, 14, 28]"]),
]
RANGES = [  # one value's range: the settings schema's, which the constructor does not re-run
    ({"patch_size": 0}, ["model.patch_size=0", ">= 1"]),
    ({"depth": 0}, ["model.depth=0"]),
    ({"mlp_ratio": -1.0}, ["model.mlp_ratio=-1.0"]),
    ({"dropout": 1.5}, ["model.dropout=1.5", "[0, 1)"]),
    ({"attention_impl": "flash"}, ["model.attention_impl=flash", "explicit"]),
    ({"stem": "resnet"}, ["model.stem=resnet", "'conv'"]),
    ({"num_heads": -2}, ["model.num_heads=-2", "positive integer"]),
    ({"embed_dim": 0}, ["model.embed_dim=0", ">= 1"]),
]


@pytest.mark.parametrize(("kwargs", "words"), SHAPES)
def test_the_constructor_refuses_impossible_shapes_naming_values(kwargs, words):
    with pytest.raises(ConfigError) as info:
        VisionTransformer(**kwargs)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(("kwargs", "words"), SHAPES + RANGES)
def test_check_model_args_refuses_shapes_and_ranges_naming_values(kwargs, words):
    # check_model_args (train's check before any data is loaded) takes the values left out
    # from the constructor: img_size=28, num_heads=4.
    with pytest.raises(ConfigError) as info:
        check_model_args(kwargs)
    for word in words:
        assert word in str(info.value)


def test_check_model_args_takes_the_convnets_defaults():
    check_model_args({"arch": "cnn"})
    with pytest.raises(ConfigError, match="img_size=30"):
        check_model_args({"arch": "cnn", "img_size": 30})


def test_wrong_image_size_is_a_clear_error():
    model = VisionTransformer(patch_size=7, **TINY)
    with pytest.raises(ValueError, match=r"\(32, 32\).*img_size=28"):
        model(torch.randn(1, 1, 32, 32))


def test_patch_embedding_is_the_convolution_it_holds():
    """ViT eq. 1 as a matrix product equals the convolution with kernel = stride = p whose
    weight it holds (the layout of every checkpoint), in values and gradients. Three
    channels, so that flattening a patch in another order than the weight's (C, p, p) shows."""
    torch.manual_seed(0)
    embed = VisionTransformer(img_size=12, patch_size=4, in_chans=3, **TINY).patch_embed
    x = torch.randn(2, 3, 12, 12)
    conv = F.conv2d(x, embed.proj.weight, embed.proj.bias, stride=4).flatten(2).transpose(1, 2)
    out = embed(x)
    torch.testing.assert_close(out, conv)
    weights = torch.randn_like(out)  # a loss whose gradient differs per token and feature
    params = [embed.proj.weight, embed.proj.bias]
    grads = torch.autograd.grad((out * weights).sum(), params)
    for grad, ref in zip(grads, torch.autograd.grad((conv * weights).sum(), params), strict=True):
        torch.testing.assert_close(grad, ref)
