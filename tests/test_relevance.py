"""Explanations beyond attention rollout: class relevance maps (Chefer et al. 2021),
gradient head importance (Michel et al. 2019) and the perturbation test of explanations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vit_mnist.analysis import attention_rollout, class_relevance, gradient_head_importance
from vit_mnist.analysis.faithfulness import blank_patches, perturbation_test
from vit_mnist.models import VisionTransformer

TINY = {"embed_dim": 16, "depth": 2, "num_heads": 2, "patch_size": 7}


def tiny(seed: int = 0, **kwargs) -> VisionTransformer:
    torch.manual_seed(seed)
    return VisionTransformer(**{**TINY, **kwargs}).eval()


def images(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 1, 28, 28, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- relevance


def test_one_layer_relevance_is_the_rule_by_hand():
    # One layer: R = I + A-bar, so the map is A-bar's CLS row over the patches,
    # mean_h max(0, dy_c/dA_h[0, j] * A_h[0, j]). The gradient is taken here by central
    # finite differences in float64, through a hook that perturbs the softmax's output.
    model = tiny(depth=1).double()
    x = images(1).double()
    target = 3
    relevance, classes = class_relevance(model, x, target)
    assert classes.tolist() == [target] and relevance.dtype == torch.float32
    softmax = model.blocks[0].attn.softmax

    def logit(delta: torch.Tensor) -> float:
        handle = softmax.register_forward_hook(lambda m, i, out: out + delta)
        try:
            with torch.no_grad():
                return float(model(x)[0, target])
        finally:
            handle.remove()

    with torch.no_grad():
        _, (a,) = model.forward_with_attention(x)
    heads, t = a.shape[1], a.shape[-1]
    eps = 1e-6
    expected = torch.zeros(t - 1, dtype=torch.float64)
    for h in range(heads):
        for j in range(1, t):
            delta = torch.zeros_like(a)
            delta[0, h, 0, j] = eps
            grad = (logit(delta) - logit(-delta)) / (2 * eps)
            expected[j - 1] += max(0.0, grad * float(a[0, h, 0, j])) / heads
    assert expected.max() > 0
    torch.testing.assert_close(relevance[0].flatten().double(), expected, rtol=1e-5, atol=1e-9)


def test_two_layers_multiply_in_order():
    # R = (I + A-bar_2)(I + A-bar_1): the later layer on the left.
    model = tiny(depth=2)
    x = images(2)
    saved = []

    def keep(module, inputs, out):  # returns None: the output is left as it is
        out.retain_grad()
        saved.append(out)

    handles = [b.attn.softmax.register_forward_hook(keep) for b in model.blocks]
    logits = model(x)
    for handle in handles:
        handle.remove()
    c = logits.argmax(1)
    logits.gather(1, c[:, None]).sum().backward()
    eye = torch.eye(17)
    a1, a2 = ((a.grad * a).clamp(min=0).mean(1).detach() for a in saved)
    expected = ((eye + a2) @ (eye + a1))[:, 0, 1:].reshape(2, 4, 4)
    model.zero_grad(set_to_none=True)
    relevance, classes = class_relevance(model, x)
    assert torch.equal(classes, c)
    torch.testing.assert_close(relevance, expected)


def test_batch_equals_one_image_at_a_time():
    model = tiny(depth=3)
    x = images(5)
    for target in (None, 7, torch.tensor([0, 9, 2, 2, 5])):
        batched, classes = class_relevance(model, x, target)
        for i in range(5):
            t = target[i : i + 1] if isinstance(target, torch.Tensor) else target
            single, c = class_relevance(model, x[i : i + 1], t)
            torch.testing.assert_close(batched[i : i + 1], single)
            assert c.item() == classes[i].item()
        # Chunks of the batch give the same maps.
        torch.testing.assert_close(class_relevance(model, x, target, batch_size=2)[0], batched)


def test_fused_model_gives_the_explicit_models_maps():
    explicit = tiny(depth=3)
    fused = VisionTransformer(**{**TINY, "depth": 3}, attention_impl="fused").eval()
    fused.load_state_dict(explicit.state_dict())
    x = images(4)
    a, ca = class_relevance(explicit, x)
    b, cb = class_relevance(fused, x)
    assert torch.equal(ca, cb)
    torch.testing.assert_close(a, b)


def test_classes_differ_where_rollout_is_one():
    model = tiny(depth=3)
    x = images(3)
    with torch.no_grad():
        _, weights = model.forward_with_attention(x)
    rollout = attention_rollout(weights)  # takes no class: one map for every class
    r0, c0 = class_relevance(model, x, 0)
    r1, c1 = class_relevance(model, x, 1)
    assert c0.tolist() == [0, 0, 0] and c1.tolist() == [1, 1, 1]
    assert rollout.shape == (3, 17, 17)
    for i in range(3):
        assert (r0[i] - r1[i]).abs().max() > 0.05 * r0[i].abs().max()


def test_parameters_untouched_mode_restored_and_bad_targets():
    model = tiny(dropout=0.1).train()
    frozen = model.head.weight
    frozen.grad = torch.ones_like(frozen)  # a gradient the caller had: must stay as it was
    relevance, _ = class_relevance(model, images(2))
    assert model.training
    assert torch.equal(frozen.grad, torch.ones_like(frozen))
    assert all(p.grad is None for p in model.parameters() if p is not frozen)
    assert (relevance >= 0).all()
    # Frozen parameters: the maps are still there.
    model.requires_grad_(False)
    torch.testing.assert_close(class_relevance(model, images(2))[0], relevance)
    with pytest.raises(ValueError, match="outside 0..9"):
        class_relevance(model, images(2), 10)
    with pytest.raises(ValueError, match="shape"):
        class_relevance(model, images(2), torch.tensor([1, 2, 3]))
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        class_relevance(model, images(2))


def test_causal_model_has_nothing_to_explain():
    # The CLS token (token 0) sees only itself: the logits ignore the patches.
    relevance, _ = class_relevance(tiny(causal=True), images(2))
    assert relevance.shape == (2, 4, 4) and (relevance == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_relevance_on_cuda_equals_cpu():
    model = tiny(depth=3)
    x = images(4)
    cpu, c = class_relevance(model, x)
    gpu, g = class_relevance(model.cuda(), x)
    assert gpu.device.type == "cpu" and torch.equal(c, g)
    torch.testing.assert_close(gpu, cpu, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------ gradient head importance


def test_gradient_head_importance():
    model = tiny(depth=2, num_heads=4)
    x, y = images(6), torch.arange(6)
    batches = [(x[:4], y[:4]), (x[4:], y[4:])]
    importance = gradient_head_importance(model, batches)
    assert importance.shape == (2, 4) and importance.dtype == torch.float32
    assert (importance >= 0).all() and (importance > 0).all()
    assert all(p.grad is None for p in model.parameters())
    # eq. 2 per batch: |dL/d xi| of each batch's mean loss, weighted by batch size. A gate
    # xi on head h is the same as scaling its W^O columns: a finite difference in float64.
    d = model.blocks[1].attn.head_dim
    double = tiny(depth=2, num_heads=4).double()

    def loss(scale: float) -> float:
        trial = tiny(depth=2, num_heads=4).double()
        with torch.no_grad():
            trial.blocks[1].attn.proj.weight[:, 2 * d : 3 * d] *= scale
            return F.cross_entropy(trial(x[:4].double()), y[:4]).item()

    eps = 1e-6
    expected = abs(loss(1 + eps) - loss(1 - eps)) / (2 * eps)
    one_batch = gradient_head_importance(double, batches[:1])
    assert one_batch[1, 2].item() == pytest.approx(expected, rel=1e-4)
    # A head whose W^O columns are zero changes nothing: its gate's gradient is 0.
    with torch.no_grad():
        model.blocks[0].attn.proj.weight[:, 1 * d : 2 * d] = 0
    zeroed = gradient_head_importance(model, batches)
    assert zeroed[0, 1] == 0 and (zeroed[0, [0, 2, 3]] > 0).all()
    # The model's mode is restored, also when the call is refused.
    model.train()
    with pytest.raises(ValueError, match="no images"):
        gradient_head_importance(model, [])
    with pytest.raises(ValueError, match="mask of shape"):
        gradient_head_importance(model, batches, mask=torch.ones(3, 4))
    assert model.training


# ------------------------------------------------------------------------- faithfulness


class PatchVote(nn.Module):
    """A known classifier: class c's logit is the mean pixel of patch ``CLASS_PATCH[c]``."""

    CLASS_PATCH = (0, 5, 10, 15)  # on the 4 x 4 grid of 7 x 7 patches

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 1, 28, 28), requires_grad=False)
        for c, p in enumerate(self.CLASS_PATCH):
            r, col = divmod(p, 4)
            self.weight.data[c, 0, 7 * r : 7 * r + 7, 7 * col : 7 * col + 7] = 1 / 49

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bchw,kchw->bk", x, self.weight)


def test_blank_patches():
    x = torch.randn(2, 1, 28, 28)
    order = torch.tensor([[5, 0, *range(1, 5), *range(6, 16)], list(range(16))])
    assert torch.equal(blank_patches(x, order, 0, fill=-1.0), x)
    assert (blank_patches(x, order, 16, fill=-1.0) == -1).all()
    one = blank_patches(x, order, 1, fill=-1.0)
    assert (one[0, 0, 7:14, 7:14] == -1).all() and (one[1, 0, :7, :7] == -1).all()
    changed = (one != x).sum(dim=(1, 2, 3))
    assert changed.tolist() == [49, 49]


def test_perturbation_test_orders_methods():
    g = torch.Generator().manual_seed(0)
    n, fill = 200, -0.4242
    labels = torch.randint(0, 4, (n,), generator=g)
    x = torch.full((n, 1, 28, 28), fill)
    ink = torch.rand(n, 16, generator=g) * 2  # every patch some ink, below 3
    ink[torch.arange(n), torch.tensor(PatchVote.CLASS_PATCH)[labels]] = 3.0
    x += ink.view(n, 1, 4, 4).repeat_interleave(7, 2).repeat_interleave(7, 3)
    labels[:40] = (labels[:40] + 1) % 4  # some wrong labels: accuracy 0.8
    model = PatchVote()
    oracle = torch.rand(n, 16, generator=g) * 0.1
    oracle[torch.arange(n), torch.tensor(PatchVote.CLASS_PATCH)[model(x).argmax(1)]] = 1.0
    scores = {
        "oracle": oracle.view(n, 4, 4),
        "random": torch.rand(n, 4, 4, generator=g),
    }
    result = perturbation_test(model, x, labels, scores, fill=fill, batch_size=64)
    accuracy = (model(x).argmax(1) == labels).float().mean().item()
    assert accuracy == pytest.approx(0.8)
    assert result.fractions.tolist() == [k / 16 for k in range(17)]
    for method in scores:
        for direction in ("positive", "negative"):
            curve = result.accuracy[method][direction]
            assert curve.shape == (17,)
            assert curve[0].item() == pytest.approx(accuracy)  # nothing blanked yet
    rows = {r["method"]: r for r in result.rows()}
    assert list(rows) == ["oracle", "random"]
    assert set(rows["oracle"]) == {"method", "positive_auc", "negative_auc"}
    # The explanation that knows beats random both ways; random sits between.
    assert rows["oracle"]["positive_auc"] < rows["random"]["positive_auc"] - 0.2
    assert rows["random"]["negative_auc"] < rows["oracle"]["negative_auc"] - 0.2
    assert rows["oracle"]["positive_auc"] < rows["random"]["negative_auc"]
    assert rows["random"]["positive_auc"] < rows["oracle"]["negative_auc"]
    with pytest.raises(ValueError, match="one g for all"):
        perturbation_test(model, x, labels, {"bad": torch.rand(n, 3, 3)}, fill=fill)
