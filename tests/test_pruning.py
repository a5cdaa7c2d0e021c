"""Head pruning (Michel et al. 2019, section 4): the cut-down weights compute what the
zeroed heads compute, a model with one head count per block is the textbook attention,
every measure but random keeps the head that carries the answer, ``prune.max_drop`` picks
the most-pruned step within its budget, and ``eval.py analysis=prune`` chooses on the
validation split and writes a smaller checkpoint that evaluates, predicts, exports, opens
in the explorer and fine-tunes like any other."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import compose_config
from tests.helpers import assert_same_values_and_gradients, count_applies
from tests.test_attention import textbook_mha
from vit_mnist.analysis.heads import gradient_head_importance, heads_zeroed
from vit_mnist.analysis.pruning import (
    MEASURES,
    Step,
    best_choice,
    choose_step,
    mean_accuracy,
    measure_data,
    prune_heads,
    prune_in_order,
)
from vit_mnist.errors import ConfigError
from vit_mnist.models.attention import MultiHeadSelfAttention
from vit_mnist.models.vit import VisionTransformer
from vit_mnist.speed import native
from vit_mnist.speed.choose import PATHS, candidates
from vit_mnist.tasks.evaluate import evaluate
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


KEY = (1, 1)  # the head that carries the answer in _one_head_answers


def _one_head_answers() -> tuple[VisionTransformer, torch.Tensor, torch.Tensor]:
    """A model in which head 1 of block 1 alone carries the answer, images and labels: no
    biases or position embedding and a small CLS token (constants that would decide every
    image's logits), the MLPs' outputs zeroed and the other heads' scaled down 50x, so the
    logits are what that head writes; the labels are the model's own predictions."""
    net = _model()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("bias") or name in ("cls_token", "pos_embed"):
                p.zero_()
        # A small constant beside the head's output: the final LayerNorm would otherwise
        # divide out a change of the head's scale (its gate), which the gradient measure
        # reads. Logits not saturated, as a trained model's: a confident answer has no
        # loss gradient.
        net.cls_token.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
        net.head.weight /= 10
        for layer, block in enumerate(net.blocks):
            block.mlp.fc2.weight.zero_()
            for head in range(4):
                if (layer, head) != KEY:
                    block.attn.proj.weight[:, head * 8 : (head + 1) * 8] /= 50
    images = torch.randn(200, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        labels = net(images).argmax(1)
    assert labels.unique().numel() >= 5  # a real classification, not one class
    return net, images, labels


@pytest.mark.parametrize("order", sorted(set(MEASURES) - {"random"}))
def test_every_measure_but_random_removes_the_head_that_carries_the_answer_last(order):
    net, images, labels = _one_head_answers()
    with torch.no_grad():
        logits = net(images)
    data = measure_data(images, labels, logits, num_images=200, normalise=False)
    assert data.pairs, "the patching measure has class pairs to patch"
    scores = MEASURES[order](net, data)
    assert scores.flatten().argmax().item() == KEY[0] * 4 + KEY[1]  # ranked first

    def score(model, args):
        with torch.no_grad():
            return (model(images).argmax(1) == labels).float().mean().item(), 0.0

    # Down to one head per block, a head a step: the answer's head is never chosen, so it
    # is what remains of its block.
    steps = prune_in_order(net, ARGS, order, data, score, per_step=1, target=6)
    assert [len(s.removed) for s in steps] == list(range(7))
    assert all(KEY not in s.removed for s in steps)
    assert steps[-1].val_acc > 0.5  # the answer mostly survives pruning 6 of 8 heads
    assert steps[0].val_acc == 1.0
    # Zeroing it instead costs the answer: the test would mean nothing otherwise.
    with heads_zeroed(net, *KEY[:1], [KEY[1]]), torch.no_grad():
        assert (net(images).argmax(1) == labels).float().mean() < 0.4


def test_max_drop_picks_the_most_pruned_step_within_the_budget():
    curve = [0.990, 0.991, 0.988, 0.9849, 0.986, 0.970, 0.984]
    assert choose_step(curve, 0.5) == 4  # 0.9849 is 0.51 points down; 0.986 is within
    assert choose_step(curve, 0.6) == 6  # the last step within 0.6, past the dip at 5
    assert choose_step(curve, 0.0) == 1  # only as good as unpruned: step 1 (0.991)
    assert choose_step(curve, 100) == 6

    def steps(order, accs):
        return [Step(order, [(0, h) for h in range(i)], [], acc, 0.0) for i, acc in enumerate(accs)]

    curves = {"a": steps("a", [0.99, 0.99, 0.97]), "b": steps("b", [0.99, 0.989, 0.988])}
    assert best_choice(curves, 0.5) == ("b", 2)  # b removes 2 heads within budget, a 1
    assert best_choice(curves, 5.0) == ("b", 2)  # both remove 2: b keeps more accuracy
    assert mean_accuracy(curves["a"], "val_acc") == pytest.approx((0.99 + 0.98) / 2)


def _checkpoint(tmp_path) -> Path:
    """A checkpoint as train() writes it, without the training: synthetic data, 8 heads."""
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
    return ckpt


COMMON = ["trainer=cpu", "logger=[]", "prune.orders=[gradient,ablation,random]"]


def test_eval_prunes_and_the_pruned_checkpoint_is_used_like_any_other(
    tmp_path, monkeypatch, capsys, caplog
):
    from tests.helpers import in_process
    from tests.test_predict import draw_digit
    from vit_mnist.tasks.explore import load_explorer

    caplog.set_level("INFO", logger="vit_mnist")
    ckpt = _checkpoint(tmp_path)
    cfg = compose_config(
        "eval",
        [f"ckpt_path={ckpt}", "analysis=prune", "prune.max_drop=100", *COMMON],
        tmp_path / "e",
    )
    metrics = evaluate(cfg)
    rows = list(csv.DictReader((tmp_path / "e" / "pruning.csv").open()))
    assert list(rows[0]) == [
        "order", "heads_removed", "heads_kept", "fraction_removed", "val_acc", "val_loss",
        "test_acc", "test_loss", "removed",
    ]  # fmt: skip
    # ceil(10% of 8) = 1 head per step, up to 75%: 6 of 8 heads, one left per block.
    for order in ("gradient", "ablation", "random"):
        assert [int(r["heads_removed"]) for r in rows if r["order"] == order] == list(range(7))
    assert float(rows[0]["test_acc"]) == pytest.approx(metrics["test/acc"], abs=1e-6)
    # max_drop=100: the last step, kept by the order with the best validation accuracy there.
    assert metrics["pruning/heads_kept"] == 2 and metrics["pruning/num_heads"] == [1, 1]
    last = [r for r in rows if r["order"] == metrics["pruning/order"]][-1]
    assert metrics["pruning/val_acc"] == pytest.approx(float(last["val_acc"]), abs=1e-6)
    pruned_ckpt = tmp_path / "e" / Path(metrics["pruning/ckpt"]).name
    assert pruned_ckpt.name == (
        f"pruned-{metrics['pruning/order']}-keeps-2-of-8-heads-val-"
        f"{100 * float(last['val_acc']):.2f}.ckpt"
    )
    speed = metrics["pruning/speed"]
    assert speed["params"]["pruned"] < speed["params"]["unpruned"]
    assert speed["images_per_s"]["pruned"] > 0 and speed["device"]
    assert (tmp_path / "e" / "pruning.png").is_file()
    assert pruned_ckpt.stat().st_size < ckpt.stat().st_size
    out = capsys.readouterr().out
    assert "images/s pruned" in out
    assert f"kept {pruned_ckpt}: 2 of 8 heads" in caplog.text  # in the run's eval.log too

    # eval.py, predict.py, export.py and the explorer take it like any other checkpoint.
    again = evaluate(
        compose_config("eval", [f"ckpt_path={pruned_ckpt}", *COMMON[:2]], tmp_path / "p")
    )
    assert again["test/acc"] == pytest.approx(float(last["test_acc"]), abs=1e-6)
    digit = draw_digit(tmp_path / "seven.png", seed=7)
    run = [f"ckpt_path={pruned_ckpt}", f"hydra.run.dir={tmp_path / 'predict'}"]
    code, out, err = in_process(monkeypatch, capsys, *run, f"images=[{digit}]", task="predict")
    assert code == 0, err[-2000:]
    assert (tmp_path / "predict" / "predictions.csv").read_text().count("seven.png") == 1
    assert "2 of 8 heads" in out and "images/s against" in out
    run = [f"ckpt_path={pruned_ckpt}", f"hydra.run.dir={tmp_path / 'export'}", "format=torchscript"]
    code, _, err = in_process(monkeypatch, capsys, *run, task="export")
    assert code == 0, err[-2000:]
    explorer = load_explorer(
        compose_config("explore", [f"ckpt_path={pruned_ckpt}"], tmp_path / "x")
    )
    assert explorer.view(explorer.examples[0][:1]).explanation.probs.shape == (10,)
    loaded = ViTClassifier.load_from_checkpoint(pruned_ckpt, weights_only=True)
    assert _params(loaded.net) == speed["params"]["pruned"]
    again = [f"ckpt_path={pruned_ckpt}", "analysis=prune", *COMMON]
    with pytest.raises(ConfigError, match="pruned already .* prune the checkpoint it came from"):
        evaluate(compose_config("eval", again, tmp_path / "twice"))

    # trainer.limit_test_batches holds for every figure: the per-class report and each
    # pruning step score the same one batch of 64 images as the test loop.
    limited = [f"ckpt_path={ckpt}", "analysis=prune", "trainer.limit_test_batches=1", *COMMON]
    limited.append("prune.step_fraction=0.4")
    one_batch = evaluate(compose_config("eval", limited, tmp_path / "one"))
    assert one_batch["num_test_images"] == 64
    rows = list(csv.DictReader((tmp_path / "one" / "pruning.csv").open()))
    assert float(rows[0]["test_acc"]) == pytest.approx(one_batch["test/acc"], abs=1e-6)


def test_the_test_set_is_not_read_before_the_pruning_is_chosen(tmp_path, monkeypatch):
    from vit_mnist.data.synthetic import SyntheticDataModule

    calls: list[str] = []
    for split in ("val", "test"):
        method = getattr(SyntheticDataModule, f"{split}_dataloader")

        def recorded(self, method=method, split=split):
            calls.append(split)
            return method(self)

        monkeypatch.setattr(SyntheticDataModule, f"{split}_dataloader", recorded)
    ckpt = _checkpoint(tmp_path)
    overrides = [f"ckpt_path={ckpt}", "analysis=prune", *COMMON, "prune.step_fraction=0.4"]
    metrics = evaluate(compose_config("eval", overrides, tmp_path / "e"))
    assert calls[0] == "val" and "test" in calls
    assert "val" not in calls[calls.index("test") :], calls  # every choice made before
    assert metrics["pruning/test_acc"] is not None


def test_a_pruned_model_fine_tunes_with_its_runs_own_recipe(tmp_path, monkeypatch, capsys):
    """``prune.finetune_epochs``: ``train.py init_from=<pruned>`` with the run's own config
    (tests/fixtures' run of d52c075, whose config names that version's module paths)."""
    import tarfile

    from tests.test_old_runs import FIXTURE

    with tarfile.open(FIXTURE) as archive:
        archive.extractall(tmp_path, filter="data")
    (best,) = (tmp_path / "run" / "checkpoints").glob("best-*.ckpt")
    overrides = [f"ckpt_path={best}", "analysis=prune", "prune.finetune_epochs=1", *COMMON]
    metrics = evaluate(compose_config("eval", overrides, tmp_path / "e"))
    tuned = json.loads((tmp_path / "e" / "finetune" / "metrics.json").read_text())
    assert tuned["init_from"] == metrics["pruning/ckpt"] and tuned["epochs"] == 1
    assert tuned["model"]["num_heads"] == [1]  # the fixture's 2 heads, one removed
    given = (tmp_path / "e" / "finetune" / ".hydra" / "overrides.yaml").read_text()
    assert "++module.lr=0.001" in given and "++module.warmup_epochs=0.5" in given
    # Still a pruned model: predict.py gives its speed beside the unpruned shape's.
    fine = torch.load(tuned["best_ckpt"], map_location="cpu", weights_only=True)
    assert fine["vit_mnist"]["pruned_from"]["order"] == metrics["pruning/order"]
    assert metrics["pruning/finetune"]["test/acc"] == tuned["test/acc"]
    assert "fine-tuned 1 epoch(s): test" in capsys.readouterr().out
    # Outside its run dir, the fine-tune is refused before any work, naming the fix.
    alone = tmp_path / "alone.ckpt"
    alone.write_bytes(best.read_bytes())
    overrides[0] = f"ckpt_path={alone}"
    with pytest.raises(ConfigError, match="init_from=<it>"):
        evaluate(compose_config("eval", overrides, tmp_path / "f"))
    assert not (tmp_path / "f" / "pruning.csv").exists()


def test_the_ablation_measure_is_the_loss_increase_with_the_head_zeroed():
    """Started part-way through the model (from the residual stream after the head's
    block's attention), it gives what zeroing the head in a whole forward pass gives."""
    import torch.nn.functional as F

    from vit_mnist.analysis.heads import each_head_zeroed
    from vit_mnist.analysis.pruning import MeasureData

    net = _model()
    x, y = torch.randn(100, 1, 28, 28), torch.randint(0, 10, (100,))
    measured = MEASURES["ablation"](net, MeasureData(x, y, batch_size=32))
    with torch.no_grad():
        base = F.cross_entropy(net(x), y).item()
        zeroed = torch.zeros(2, 4)
        for layer, head, loss in each_head_zeroed(net, lambda: F.cross_entropy(net(x), y).item()):
            zeroed[layer, head] = loss - base
    torch.testing.assert_close(measured, zeroed, atol=1e-5, rtol=1e-4)
    assert zeroed.abs().max() > 0.05  # the heads matter: the comparison means something


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["prune.max_drop=1"], "prune.max_drop=1 applies to analysis=prune only"),
        (["analysis=prune", "prune.finetune_lr=5e-4"], "add prune.finetune_epochs=2"),
        (
            ["analysis=prune", "++prune.finetune_warmup_epochs=1"],
            "++prune.finetune_warmup_epochs=1",
        ),
    ],
)
def test_a_prune_setting_that_would_not_be_applied_is_refused(
    tmp_path, monkeypatch, capsys, overrides, words
):
    from tests.helpers import in_process

    run = ["ckpt_path=nowhere.ckpt", f"hydra.run.dir={tmp_path / 'e'}", *overrides]
    code, _, err = in_process(monkeypatch, capsys, *run, task="evaluate")
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
