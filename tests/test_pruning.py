"""Head pruning (Michel et al. 2019, section 4): the cut-down weights compute what the
zeroed heads compute, a model with one head count per block is the textbook attention,
and ``eval.py analysis=prune`` writes a smaller checkpoint that evaluates like any other."""

from __future__ import annotations

import csv

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import compose_config
from tests.helpers import assert_same_values_and_gradients, count_applies
from tests.test_attention import textbook_mha
from vit_mnist.analysis.heads import gradient_head_importance, heads_zeroed
from vit_mnist.analysis.pruning import prune_heads
from vit_mnist.errors import ConfigError
from vit_mnist.models.attention import MultiHeadSelfAttention
from vit_mnist.models.vit import VisionTransformer
from vit_mnist.speed import native
from vit_mnist.speed.choose import PATHS, candidates
from vit_mnist.tasks.evaluate import evaluate
from vit_mnist.tasks.train import train
from vit_mnist.training.module import ViTClassifier

ARGS = dict(embed_dim=32, depth=2, num_heads=4, patch_size=7)
CPU = torch.device("cpu")


def _model(seed: int = 0) -> VisionTransformer:
    """A tiny model whose heads all matter: weights far from the 0.02 initialisation."""
    torch.manual_seed(seed)
    net = VisionTransformer(**ARGS).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.3)
    return net


def _params(net: torch.nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


@pytest.mark.parametrize("impl", ["explicit", "fused"])
def test_pruned_heads_compute_what_zeroed_heads_compute(impl):
    net = _model()
    net.blocks[0].attn.fused = net.blocks[1].attn.fused = impl == "fused"
    removed = [(0, 1), (0, 3), (1, 0)]
    pruned, args = prune_heads(net, ARGS, removed)
    assert args["num_heads"] == [2, 3] and args["head_dim"] == 8
    # The removed heads' 3 * d_k rows of qkv (and bias) and d_k columns of W^O, each.
    assert _params(net) - _params(pruned) == 3 * (3 * 8 * 32 + 3 * 8 + 32 * 8)
    x = torch.randn(5, 1, 28, 28)
    with heads_zeroed(net, 0, [1, 3]), heads_zeroed(net, 1, [0]):
        zeroed = net(x)
    torch.testing.assert_close(pruned(x), zeroed, atol=1e-5, rtol=1e-5)
    assert (pruned(x) - net(x)).abs().max() > 1e-2  # the heads did matter
    # The gradient importance of the kept heads is the masked model's.
    mask = torch.ones(2, 4)
    mask[0, [1, 3]] = mask[1, 0] = 0
    batches = [(x, torch.arange(5))]
    grad = gradient_head_importance(pruned, batches)
    masked = gradient_head_importance(net, batches, mask=mask)
    torch.testing.assert_close(grad[0, :2], masked[0, [0, 2]], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grad[1, :3], masked[1, 1:], atol=1e-5, rtol=1e-4)


def test_prune_heads_refuses_a_blocks_last_head_and_unknown_heads():
    net = _model()
    with pytest.raises(ValueError, match="keep at least one"):
        prune_heads(net, ARGS, [(1, h) for h in range(4)])
    with pytest.raises(ValueError, match="no head 2:0"):
        prune_heads(net, ARGS, [(2, 0)])


@pytest.mark.parametrize("impl", ["explicit", "fused"])
def test_narrow_heads_are_the_textbook_attention(impl):
    torch.manual_seed(0)
    attn = MultiHeadSelfAttention(embed_dim=24, num_heads=2, head_dim=5, impl=impl).eval()
    assert attn.qkv.weight.shape == (30, 24) and attn.proj.weight.shape == (24, 10)
    x = torch.randn(2, 7, 24)
    torch.testing.assert_close(attn(x), textbook_mha(attn, x, False), atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="one count per block"):
        VisionTransformer(**{**ARGS, "num_heads": [2, 2, 2], "head_dim": 8})
    with pytest.raises(ConfigError, match="needs head_dim"):
        VisionTransformer(**{**ARGS, "num_heads": [2, 3]})


@pytest.mark.isa
def test_speed_paths_run_a_pruned_model(monkeypatch):
    """Fewer heads than embed_dim / head_dim: every eager path, the C++ attention kernel
    included (it reads each head at head * head_dim of the packed projection), gives the
    pruned model's values and every parameter's gradient."""
    pruned, _ = prune_heads(_model(), ARGS, [(0, 1), (1, 0), (1, 2)])
    x = torch.randn(3, 1, 28, 28)
    params = list(pruned.parameters())
    pairs, skipped = candidates(CPU, "auto", "32-true", False, pruned)
    assert skipped.keys() <= {"native", "compile"} and "compile" in skipped
    assert ("native" in skipped) == (PATHS["native"].unavailable(CPU) is not None)
    kernel_calls = count_applies(monkeypatch, native.FusedCPUAttention)
    for name, _ in pairs:  # values and every parameter's gradient
        fast = PATHS[name].build(pruned)(x)
        assert_same_values_and_gradients(fast, pruned(x), params, atol=1e-5, rtol=1e-4)
    assert len(kernel_calls) == (2 if ("native", "32-true") in pairs else 0)  # one per block


def test_eval_prunes_and_the_pruned_checkpoint_evaluates_alike(tmp_path):
    # A checkpoint as train() writes it, without the training: synthetic data, 8 heads.
    module = ViTClassifier(model={**ARGS, "num_classes": 10})
    module.net.load_state_dict(_model().state_dict())
    data = OmegaConf.to_container(compose_config("eval", ["data=synthetic"], tmp_path).data)
    ckpt = tmp_path / "model.ckpt"
    torch.save(
        {
            "state_dict": module.state_dict(),
            "hyper_parameters": dict(module.hparams),
            "pytorch-lightning_version": "2.5.0",
            "vit_mnist": {"data": data, "precision": "32-true", "seed": 0},
        },
        ckpt,
    )
    common = ["trainer=cpu", "logger=[]"]
    cfg = compose_config("eval", [f"ckpt_path={ckpt}", "analysis=prune", *common], tmp_path / "e")
    metrics = evaluate(cfg)
    rows = list(csv.DictReader((tmp_path / "e" / "pruning.csv").open()))
    assert list(rows[0]) == [
        "step", "heads_removed", "fraction_removed", "test_acc", "test_loss", "removed"
    ]  # fmt: skip
    # ceil(10% of 8) = 1 head per step, up to 75%: 6 of 8 heads, one left per block.
    assert [int(r["heads_removed"]) for r in rows] == list(range(7))
    assert float(rows[0]["test_acc"]) == pytest.approx(metrics["test/acc"], abs=1e-6)
    assert metrics["pruning/acc_at_75pct"] == float(rows[-1]["test_acc"])
    assert metrics["pruning/num_heads"] == [1, 1]
    assert (tmp_path / "e" / "pruning.png").is_file()
    assert metrics["pruning/params_pruned"] < metrics["pruning/params"]
    pruned_ckpt = tmp_path / "e" / "pruned.ckpt"
    assert pruned_ckpt.stat().st_size < ckpt.stat().st_size
    cfg = compose_config("eval", [f"ckpt_path={pruned_ckpt}", *common], tmp_path / "p")
    again = evaluate(cfg)
    assert again["test/acc"] == pytest.approx(float(rows[-1]["test_acc"]), abs=1e-6)
    # The head roles of the pruned model: its one remaining head per block.
    overrides = [f"ckpt_path={pruned_ckpt}", "analysis=roles", *common]
    evaluate(compose_config("eval", overrides, tmp_path / "r"))
    roles = list(csv.DictReader((tmp_path / "r" / "roles.csv").open()))
    assert [(r["layer"], r["head"]) for r in roles] == [("0", "0"), ("1", "0")]
    loaded = ViTClassifier.load_from_checkpoint(pruned_ckpt, weights_only=True)
    assert _params(loaded.net) == metrics["pruning/params_pruned"]
    # Fine-tuning: train.py init_from= starts a new run from the pruned model's arguments and
    # weights (1 head per block), with a fresh optimizer.
    # No model.* keys given: those would have to match the checkpoint's (tests/test_faults.py).
    fine_tune = [
        "data=synthetic",
        "trainer=cpu",
        "trainer.max_epochs=1",
        f"init_from={pruned_ckpt}",
    ]
    fine_tune += ["speed.path=reference", "trainer.precision=32-true"]
    tuned = train(compose_config("train", fine_tune, tmp_path / "t"))
    assert tuned["model"]["num_heads"] == [1, 1] and tuned["init_from"] == str(pruned_ckpt)
    assert tuned["num_params"] == metrics["pruning/params_pruned"]
    assert tuned["epochs"] == 1

    # trainer.limit_test_batches holds for every figure: the per-class report and each
    # pruning step score the same one batch of 64 images as the test loop.
    limited = [f"ckpt_path={ckpt}", "analysis=prune", "trainer.limit_test_batches=1", *common]
    one_batch = evaluate(compose_config("eval", limited, tmp_path / "one"))
    assert one_batch["num_test_images"] == 64
    rows = list(csv.DictReader((tmp_path / "one" / "pruning.csv").open()))
    assert float(rows[0]["test_acc"]) == pytest.approx(one_batch["test/acc"], abs=1e-6)
