"""What heads write: the decomposed forward pass, direct logit attribution, activation
patching and the logit lens, each checked against an exact answer."""

from __future__ import annotations

import pytest
import torch

from vit_mnist.analysis.components import resume, run_components
from vit_mnist.analysis.heads import heads_switched_off
from vit_mnist.analysis.logit_attribution import direct_logit_attribution, margin_attribution
from vit_mnist.analysis.logit_lens import logit_lens
from vit_mnist.analysis.patching import KINDS, activation_patching
from vit_mnist.models import VisionTransformer

TINY = {"embed_dim": 16, "depth": 2, "num_heads": 2, "patch_size": 7, "mlp_ratio": 2.0}
VARIANTS = {
    "plain": {},
    "distilled": {"distillation": True},
    "pruned": {"num_heads": [2, 1], "head_dim": 8},
    "fused": {"attention_impl": "fused"},
}


def tiny(seed: int = 0, **kwargs) -> VisionTransformer:
    torch.manual_seed(seed)
    model = VisionTransformer(**{**TINY, **kwargs}).eval()
    with torch.no_grad():  # weights of a trained model's size, not init's 0.02
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def images(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 1, 28, 28, generator=torch.Generator().manual_seed(seed))


def trained() -> tuple[VisionTransformer, torch.Tensor, torch.Tensor]:
    """A tiny ViT fitted for 60 steps to noisy class prototypes, with held-out images."""
    g = torch.Generator().manual_seed(0)
    prototypes = torch.randn(10, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (640,), generator=g)
    x = prototypes[y] + 0.8 * torch.randn(640, 1, 28, 28, generator=g)
    torch.manual_seed(0)
    model = VisionTransformer(**TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(60):
        batch = slice(64 * (step % 8), 64 * (step % 8 + 1))
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), x[512:], y[512:]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_decomposed_forward_is_the_models(variant):
    model, x = tiny(**VARIANTS[variant]), images(4)
    with torch.no_grad():
        c = run_components(model, x)
        torch.testing.assert_close(c.logits, model(x), atol=1e-5, rtol=1e-5)
        for layer in range(model.depth):  # the sum of the parts is the stream
            parts = c.resid_pre[layer] + c.heads[layer].sum(1) + c.attn_bias[layer]
            torch.testing.assert_close(parts, c.resid_mid[layer], atol=1e-5, rtol=0)
            torch.testing.assert_close(resume(model, c.resid_pre[layer], layer), c.logits)
        # A head mask as an argument removes the heads as eval.py's hooks do.
        mask = torch.ones(model.depth, 2)
        mask[0, 1] = mask[1, 0] = 0
        masked = run_components(model, x, head_mask=mask).logits
        with heads_switched_off(model, [(0, 1), (1, 0)]):
            torch.testing.assert_close(masked, model(x), atol=1e-5, rtol=1e-5)
    assert not (masked - c.logits).abs().lt(1e-6).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_direct_attributions_add_up_to_the_logits(variant):
    model, x = tiny(**VARIANTS[variant]), images(6)
    attribution = direct_logit_attribution(model, x, batch_size=4)
    with torch.no_grad():
        cls_logits, dist_logits = model.forward_heads(model.forward_features(x))
    assert attribution.contributions.shape == (6, len(attribution.names), 10)
    torch.testing.assert_close(attribution.contributions.sum(1), cls_logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(attribution.logits, cls_logits, atol=1e-4, rtol=0)
    if dist_logits is None:
        assert attribution.contributions_dist is None
    else:
        torch.testing.assert_close(
            attribution.contributions_dist.sum(1), dist_logits, atol=1e-4, rtol=0
        )
    # Every head has its row, and no component is zero in a model with random weights.
    heads = sum(b.attn.num_heads for b in model.blocks)
    assert len(attribution.head_index) == heads and len(attribution.mlp_index) == model.depth
    assert attribution.contributions.abs().amax(dim=(0, 2)).gt(0).all()


def test_direct_attributions_add_up_on_a_trained_model():
    model, x, y = trained()
    assert (model(x).argmax(1) == y).float().mean() > 0.9  # it did learn
    attribution = direct_logit_attribution(model, x)
    with torch.no_grad():
        logits = model(x)
    torch.testing.assert_close(attribution.contributions.sum(1), logits, atol=1e-4, rtol=0)
    to_true, to_margin, runner_up = margin_attribution(attribution, y)
    true = logits.gather(1, y[:, None])[:, 0]
    torch.testing.assert_close(to_true.sum(1), true, atol=1e-4, rtol=0)
    margin = true - logits.gather(1, runner_up[:, None])[:, 0]
    torch.testing.assert_close(to_margin.sum(1), margin, atol=1e-4, rtol=0)
    assert (runner_up != y).all()


def one_writer(layer: int = 1, head: int = 1) -> VisionTransformer:
    """A model in which only head ``head`` of ``layer`` writes into the residual stream
    that reaches the classifier: every other head's W^O slice, every MLP's output, the CLS
    token's embedding and every bias are zero."""
    model = tiny(depth=2, num_heads=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and "norm" not in name:
                p.zero_()
        model.cls_token.zero_()
        model.pos_embed[:, 0].zero_()
        model.norm.bias.zero_()
        d = model.blocks[0].attn.head_dim
        for i, block in enumerate(model.blocks):
            block.mlp.fc2.weight.zero_()
            for h in range(block.attn.num_heads):
                if (i, h) != (layer, head):
                    block.attn.proj.weight[:, h * d : (h + 1) * d] = 0
    return model


def test_one_writing_head_gets_all_attribution_and_all_patching():
    model = one_writer(layer=1, head=1)
    x = images(8)
    attribution = direct_logit_attribution(model, x)
    writer = attribution.names.index("L1H1")
    assert attribution.contributions[:, writer].abs().min() > 0
    others = torch.cat(
        [attribution.contributions[:, :writer], attribution.contributions[:, writer + 1 :]], 1
    )
    assert others.abs().max() < 1e-6
    torch.testing.assert_close(
        attribution.contributions[:, writer], attribution.logits, atol=1e-5, rtol=0
    )

    clean, corrupted = x[:4], images(4, seed=7)
    result = activation_patching(model, clean, corrupted, 0, 1)
    assert (result.clean_ld.mean() - result.corrupted_ld.mean()).abs() > 1e-3
    for direction in ("denoising", "noising"):
        heads = result.score(direction, "heads")
        expected = torch.zeros(2, 2)
        expected[1, 1] = 1
        torch.testing.assert_close(heads, expected, atol=1e-4, rtol=0)
        torch.testing.assert_close(
            result.score(direction, "mlp"), torch.zeros(2), atol=1e-4, rtol=0
        )
        # By token: the classifier reads the CLS token only, in the last layer.
        by_token = result.score(direction, "heads_by_position")[1, 1]
        assert abs(float(by_token[0]) - 1) < 1e-4 and by_token[1:].abs().max() < 1e-4


def test_patching_nothing_gives_the_corrupted_logits_and_the_whole_stream_the_clean():
    model = tiny(depth=3)
    clean, corrupted = images(5, seed=2), images(5, seed=3)
    # Patching a run with its own activations: every patched run is the unpatched one.
    same = activation_patching(model, corrupted, corrupted, 2, 5)
    for direction in ("denoising", "noising"):
        for kind in KINDS:
            patched = same.patched[direction][kind]
            expected = same.corrupted_ld.view(-1, *[1] * (patched.ndim - 1)).expand_as(patched)
            torch.testing.assert_close(patched, expected, atol=1e-4, rtol=0)
    result = activation_patching(model, clean, corrupted, 2, 5)
    with torch.no_grad():
        logits = model(torch.cat([clean, corrupted]))
    ld = logits[:, 2] - logits[:, 5]
    torch.testing.assert_close(result.clean_ld, ld[:5], atol=1e-4, rtol=0)
    torch.testing.assert_close(result.corrupted_ld, ld[5:], atol=1e-4, rtol=0)
    # The whole residual stream before any block: the clean run (denoising), the
    # corrupted run (noising), pair by pair.
    denoised = result.patched["denoising"]["resid_all"]  # (N, depth)
    noised = result.patched["noising"]["resid_all"]
    torch.testing.assert_close(denoised, ld[:5, None].expand(-1, 3), atol=1e-4, rtol=0)
    torch.testing.assert_close(noised, ld[5:, None].expand(-1, 3), atol=1e-4, rtol=0)
    for direction in ("denoising", "noising"):
        torch.testing.assert_close(
            result.score(direction, "resid_all"), torch.ones(3), atol=1e-4, rtol=0
        )


def test_patching_a_pruned_model_leaves_its_missing_heads_empty():
    model = tiny(num_heads=[2, 1], head_dim=8)
    result = activation_patching(model, images(3), images(3, seed=5), kinds=("heads",))
    heads = result.score("denoising", "heads")
    assert heads.shape == (2, 2) and heads[1, 1].isnan() and not heads[0].isnan().any()
    rows = result.rows(["CLS"] + [str(i) for i in range(16)])
    assert {(r["layer"], r["head"]) for r in rows} == {(0, 0), (0, 1), (1, 0)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_logit_lens_at_the_last_layer_is_the_prediction(variant):
    model, x = tiny(**VARIANTS[variant]), images(12)
    labels = torch.arange(12) % 10
    lens = logit_lens(model, x, labels, batch_size=5)
    with torch.no_grad():
        logits = model(x)
    assert lens.logits.shape == (12, model.depth, 10)
    torch.testing.assert_close(lens.logits[:, -1], logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(lens.predictions[:, -1], logits.argmax(1))
    assert float(lens.agreement[-1]) == 1.0
    assert float(lens.accuracy[-1]) == float((logits.argmax(1) == labels).float().mean())
    # Classes 0 and 1 have two images each here; the others one.
    assert lens.class_accuracy.shape == (model.depth, 10)
