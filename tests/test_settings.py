"""The schema of every setting (vit_mnist/settings.py): each shipped config passes it, and a
bad value of any kind is one ConfigError naming the key and the value."""

from __future__ import annotations

import copy
import functools
import logging
import re
from pathlib import Path

import pytest
import yaml
from omegaconf import DictConfig, OmegaConf

from tests.conftest import ROOT, compose_config
from vit_mnist.errors import ConfigError
from vit_mnist.settings import SETTINGS, check_settings

EXPERIMENTS = sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml"))


GROUPS = ("data", "trainer", "experiment", "callbacks", "model", "module")


@functools.lru_cache
def composed(command: str, overrides: tuple[str, ...]) -> DictConfig:
    name = {"evaluate": "eval"}.get(command, command)
    return compose_config(name, list(overrides), Path("/nonexistent/run"))


def check(command: str, overrides: list[str], tmp_path=None) -> dict:
    """Compose once per choice of config groups, then set the other keys as an override
    would (composing takes 0.3 s, setting a key microseconds)."""
    groups = tuple(o for o in overrides if o.partition("=")[0] in GROUPS)
    cfg = copy.deepcopy(composed(command, groups))
    for override in overrides:
        if override not in groups:
            key, _, value = override.lstrip("+").partition("=")
            OmegaConf.update(cfg, key, yaml.safe_load(value), force_add=True)
    return check_settings(cfg, SETTINGS[command])


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        *[[f"experiment={e}"] for e in EXPERIMENTS],
        *[[f"data={d}"] for d in ("mnist", "fashion_mnist", "synthetic")],
        *[[f"trainer={t}"] for t in ("cpu", "gpu", "ddp")],
        ["callbacks=ema"],
        ["+trainer.gradient_clip_val=1.0", "+trainer.accumulate_grad_batches=2"],
        ["model.num_heads=[2,4,4,8,8,8]", "+model.head_dim=16", "seed=0"],
        ["trainer.limit_train_batches=3", "trainer.limit_val_batches=0.5"],
        ["callbacks.model_checkpoint.monitor=val/loss", "callbacks.model_checkpoint.mode=min"],
        ["callbacks.model_checkpoint=null"],
    ],
)
def test_every_shipped_train_config_passes(overrides):
    check("train", overrides)


def test_eval_predict_export_configs_pass():
    check("evaluate", ["ckpt_path=latest", "analysis=heads", "precision=bf16-mixed"])
    check("predict", ["ckpt_path=latest", "images=[a.png,b/]"])
    check("export", ["ckpt_path=latest", "format=torchscript", "data=fashion_mnist"])


BAD = [
    # (command, overrides, words the one line must hold)
    ("train", ["seed=abc"], ["seed=abc", "whole number", "seed=1"]),
    ("train", ["seed=-1"], ["seed=-1", "in [0, 2**32)"]),
    ("train", ["seed=1.5"], ["seed=1.5", "whole number"]),
    ("train", ["data.split_seed=abc"], ["data.split_seed=abc", "whole number"]),
    ("train", ["data=mnist", "data.val_size=abc"], ["data.val_size=abc", "whole number"]),
    ("train", ["module.betas=[1.5,0.9]"], ["module.betas=[1.5,0.9]", "each value", "[0, 1)"]),
    ("train", ["module.betas=[0.9]"], ["module.betas=[0.9]", "2 values"]),
    ("train", ["module.weight_decay=abc"], ["module.weight_decay=abc", "a number"]),
    ("train", ["trainer.check_val_every_n_epoch=0"], ["check_val_every_n_epoch=0", ">= 1"]),
    ("train", ["trainer.accelerator=tpu"], ["trainer.accelerator=tpu", "'cpu'"]),
    ("train", ["trainer.accelerator=mps"], ["trainer.accelerator=mps", "'cuda'"]),
    ("train", ["trainer.precision=fp8"], ["trainer.precision=fp8", "bf16-mixed"]),
    ("train", ["trainer.devices=0"], ["trainer.devices=0", "auto"]),
    ("train", ["trainer.limit_train_batches=1.5"], ["limit_train_batches=1.5", "[0, 1]"]),
    ("train", ["+model.num_head=4"], ["model.num_head", "did you mean model.num_heads"]),
    ("train", ["+foo=1"], ["foo is not a top-level setting"]),
    ("train", ["+trainer.gradient_clip=1"], ["trainer.gradient_clip", "gradient_clip_val"]),
    ("train", ["+data.num_train=5"], ["data.num_train", "MNISTDataModule"]),
    ("train", ["+callbacks.lr_monitor.foo=1"], ["callbacks.lr_monitor.foo", "logging_interval"]),
    ("train", ["data._target_=vit_mnist.data.MNISTData"], ["vit_mnist.data has no 'MNISTData'"]),
    ("train", ["data._target_=vit_mnist.dat.MNIST"], ["data._target_=vit_mnist.dat.MNIST"]),
    ("train", ["model.num_heads=[2,0]"], ["model.num_heads=[2,0]", "positive integer"]),
    ("train", ["model.attention_impl=foo"], ["model.attention_impl=foo", "explicit"]),
    ("train", ["model.causal=maybe"], ["model.causal=maybe", "true or false"]),
    ("train", ["data.augment.translate=2"], ["data.augment.translate=2", "[0, 1]"]),
    ("train", ["data.augment.degrees=-1"], ["data.augment.degrees=-1", "[0, 180]"]),
    ("train", ["data.augment.erasing=1.5"], ["data.augment.erasing=1.5", "[0, 1]"]),
    ("train", ["data.augment.erasing=-0.1"], ["data.augment.erasing=-0.1", "[0, 1]"]),
    ("train", ["data.augment.scale=[0,1]"], ["data.augment.scale=[0,1]", "> 0"]),
    ("train", ["data.augment.elastic_alpha=-1"], ["data.augment.elastic_alpha=-1", ">= 0"]),
    ("train", ["data.augment.elastic_sigma=0"], ["data.augment.elastic_sigma=0", "> 0"]),
    ("train", ["speed.compile=sometimes"], ["speed.compile=sometimes", "true or false"]),
    # More than 4 pixels moves a digit's stroke out of the frame (issue 55: 12.7% at 100).
    ("train", ["module.test_time_shift=100"], ["module.test_time_shift=100", "in [0, 4]"]),
    ("train", ["module.test_time_shift=1.5"], ["module.test_time_shift=1.5", "whole number"]),
    ("evaluate", ["ckpt_path=x", "test_time_shift=5"], ["test_time_shift=5", "in [0, 4]"]),
    ("train", ["data.std=0.7"], ["data.std=0.7", "in (0, 0.5]", "data.std=0.3081"]),
    ("train", ["data.mean=-0.1"], ["data.mean=-0.1", "in [0, 1]"]),
    ("train", ["model.num_classes=1"], ["model.num_classes=1", ">= 2"]),
    ("train", ["model.dropout=1.0"], ["model.dropout=1.0", "in [0, 1)"]),
    ("train", ["data.split_seed=-1"], ["data.split_seed=-1", "in [0, 2**64)"]),
    ("train", ["callbacks.last_checkpoint.every_n_train_steps=0"], ["every_n_train_steps=0"]),
    # Lightning would find an unlogged name only after the first validation, and stop there.
    ("train", ["callbacks.model_checkpoint.monitor=val_acc"], ["monitor=val_acc", "val/acc"]),
    ("train", ["callbacks.model_checkpoint.mode=maximum"], ["mode=maximum", "'max'"]),
    ("train", ["model.depth=null"], ["model.depth=null", "whole number"]),
    ("train", ["speed.compile=maybe"], ["speed.compile=maybe", "true or false"]),
    ("train", ["speed.remeasure=maybe"], ["speed.remeasure=maybe", "true or false"]),
    ("evaluate", ["ckpt_path=x", "precision=fp8"], ["precision=fp8", "32-true"]),
    ("evaluate", ["ckpt_path=x", "analysis=everything"], ["analysis=everything", "heads"]),
    ("evaluate", ["ckpt_path=x", "prune.max_fraction=1"], ["prune.max_fraction=1", "(0, 1)"]),
    ("evaluate", ["ckpt_path=x", "prune.orders=[gradient,magic]"], ["names magic", "ablation"]),
    ("evaluate", ["ckpt_path=x", "prune.orders=[]"], ["prune.orders=[]", "non-empty list"]),
    ("evaluate", ["ckpt_path=x", "prune.orders=[random,random]"], ["prune.orders", "twice"]),
    ("evaluate", ["ckpt_path=x", "prune.orders=gradient"], ["prune.orders=gradient", "list"]),
    ("evaluate", ["ckpt_path=x", "prune.max_drop=-1"], ["prune.max_drop=-1", "[0, 100]"]),
    ("evaluate", ["ckpt_path=x", "prune.max_drop=half"], ["prune.max_drop=half", "a number"]),
    ("evaluate", ["ckpt_path=x", "prune.finetune_epochs=1.5"], ["finetune_epochs=1.5", "whole"]),
    ("evaluate", ["ckpt_path=x", "prune.finetune_epochs=-2"], ["finetune_epochs=-2", ">= 0"]),
    ("evaluate", ["ckpt_path=x", "prune.num_images=0"], ["prune.num_images=0", ">= 1"]),
    ("evaluate", ["ckpt_path=x", "prune.save_steps=2"], ["prune.save_steps=2", "true or false"]),
    ("evaluate", ["ckpt_path=x", "faithfulness.num_images=0"], ["num_images=0", ">= 1"]),
    ("evaluate", ["ckpt_path=x", "circuits.pairs=[[4,4]]"], ["circuits.pairs", "[[4,9],[7,2]]"]),
    ("evaluate", ["ckpt_path=x", "circuits.pairs=[4,9]"], ["circuits.pairs=[4,9]", "pairs"]),
    ("evaluate", ["ckpt_path=x", "circuits.pair_images=0"], ["pair_images=0", ">= 1"]),
    ("evaluate", [], ["ckpt_path is required"]),
    ("predict", ["ckpt_path=x", "images=5"], ["images=5", "a folder"]),
    ("export", ["ckpt_path=x", "opset=abc"], ["opset=abc", "whole number"]),
    ("export", ["ckpt_path=x", "format=tflite"], ["format=tflite", "onnx"]),
    ("export", ["ckpt_path=x", "data=mnist", "data.batch_size=0"], ["data.batch_size=0"]),
]


@pytest.mark.parametrize(("command", "overrides", "words"), BAD)
def test_a_bad_setting_is_one_line_naming_key_value_and_fix(command, overrides, words, caplog):
    with pytest.raises(ConfigError) as info:
        check(command, overrides)
    message = str(info.value)
    assert "\n" not in message
    # ... and only that line: nothing logged on the way (Hydra's get_object logs an ERROR).
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    for word in words:
        assert word in message, message


def test_the_built_sections_are_the_constructors_arguments():
    """The model, module and data sections hold exactly the arguments of the classes that
    take them (read without importing them), plus model.arch, which chooses the class."""
    import inspect

    from vit_mnist import settings
    from vit_mnist.data import MNISTDataModule, SyntheticDataModule
    from vit_mnist.models import ConvNet, VisionTransformer
    from vit_mnist.training.module import ViTClassifier

    def arguments(*classes):
        return {p for c in classes for p in inspect.signature(c).parameters if p != "model"}

    assert set(settings.ModelSettings.model_fields) == arguments(VisionTransformer, ConvNet) | {
        "arch"
    }
    assert set(settings.ModuleSettings.model_fields) == arguments(ViTClassifier) | {"target"}
    assert set(settings.DataSettings.model_fields) == arguments(
        MNISTDataModule, SyntheticDataModule
    ) | {"target"}


def test_a_new_constructor_argument_is_a_setting_with_no_edit_here(tmp_path, monkeypatch):
    """A model argument is written once, in its class: the schema reads it from there, a
    run's config takes it as ``+model.KEY=VALUE``, checked, and build_model passes it on."""
    from pydantic import create_model

    from vit_mnist import settings
    from vit_mnist.models import build_model

    package = tmp_path / "newer"
    package.mkdir()
    (package / "__init__.py").write_text("")
    source = (ROOT / "vit_mnist/models/vit.py").read_text()
    stem = "        stem: str = "
    assert source.count(stem) == 1
    added = source.replace(stem, "        register_tokens: int = 0,\n" + stem)
    (package / "vit.py").write_text(added)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(settings.MODEL_CLASSES, "vit", "newer.vit.VisionTransformer")
    classes, ranges = settings.MODEL_CLASSES.values(), settings.MODEL_RANGES
    newer = settings.built_from("ModelSettings", classes, ranges)
    schema = create_model("Train", __base__=settings.TrainSettings, model=(newer, None))
    cfg = composed("train", ("data=synthetic",))
    given = copy.deepcopy(cfg)
    OmegaConf.update(given, "model.register_tokens", 4, force_add=True)
    assert check_settings(given, schema)["model"]["register_tokens"] == 4
    OmegaConf.update(given, "model.register_tokens", "four", force_add=True)
    with pytest.raises(ConfigError, match=r"model.register_tokens=four"):
        check_settings(given, schema)
    model_args = {**OmegaConf.to_container(cfg.model), "register_tokens": 4}
    assert type(build_model(model_args)).__module__ == "newer.vit"
    # A range left behind by a renamed argument is an error in the schema, said at import.
    with pytest.raises(LookupError, match="num_registers"):
        settings.built_from("Stray", ["newer.vit.VisionTransformer"], {"num_registers": 1})
    with pytest.raises(LookupError, match="stem_kind"):  # a range that narrows the type too
        settings.built_from("Stray", ["newer.vit.VisionTransformer"], {"stem_kind": (int, None)})


def test_the_settings_and_the_teacher_are_checked_once_per_run(tmp_path, monkeypatch, capsys):
    """The command line checks the schema before the imports; the run's checks
    (vit_mnist/training/checks.py) neither repeat it nor check the teacher twice."""
    from tests.conftest import ONE_EPOCH, TINY_MODEL
    from tests.helpers import in_process
    from vit_mnist import settings
    from vit_mnist.training import checks

    schema_checks, teacher_checks = [], []
    check_arguments, check_teacher = settings.check_arguments, checks.check_teacher

    def counted_arguments(section, values, prefix="", typed=None):
        schema_checks.append(section) if section is settings.TrainSettings else None
        return check_arguments(section, values, prefix, typed)

    def counted_teacher(*args, **kwargs):
        teacher_checks.append(args)
        return check_teacher(*args, **kwargs)

    monkeypatch.setattr(settings, "check_arguments", counted_arguments)
    monkeypatch.setattr(checks, "check_teacher", counted_teacher)
    run = f"hydra.run.dir={tmp_path / 'run'}"
    code, _, err = in_process(monkeypatch, capsys, *ONE_EPOCH, *TINY_MODEL, run)
    assert code == 0, err[-3000:]
    assert len(schema_checks) == 1 and len(teacher_checks) == 1


@pytest.mark.parametrize(
    ("override", "line"),
    [
        # Before: Lightning's traceback (1.5), or accepted (1: the weights the run started
        # from; 0 steps between updates: never updated).
        ("callbacks.ema.decay=1.5", "callbacks.ema.decay=1.5 must be in [0, 1)"),
        ("callbacks.ema.decay=1", "callbacks.ema.decay=1 must be in [0, 1)"),
        ("+callbacks.ema.update_every_n_steps=0", "callbacks.ema.update_every_n_steps=0 must be"),
    ],
)
def test_an_ema_that_would_not_average_is_refused_by_the_schema(make_train_cfg, override, line):
    from vit_mnist.tasks.train import train

    with pytest.raises(ConfigError, match=f"^{re.escape(line)}"):
        train(make_train_cfg("callbacks=[default,ema]", override))


def test_an_ema_that_starts_after_the_last_step_is_refused_before_training(make_train_cfg):
    """Issue 102's audit: `callbacks.ema.update_starting_at_step` past the run's end was
    accepted, and the run validated, saved and tested the weights it started from."""
    from vit_mnist.tasks.train import train

    cfg = make_train_cfg("callbacks=[default,ema]", "callbacks.ema.update_starting_at_step=16")
    with pytest.raises(ConfigError, match=r"update_starting_at_step=16, and this run's last step"):
        train(cfg)  # 2 epochs of 8 batches: steps 0 to 15
    assert not list(Path(cfg.paths.output_dir).rglob("*.ckpt"))


def test_a_distillation_temperature_that_is_not_finite_is_refused():
    # Issue 102's audit: inf passed `> 0`; it softens every output to uniform, and the
    # loss (times tau**2) to NaN.
    from vit_mnist.settings import ModuleSettings, check_arguments

    with pytest.raises(ConfigError, match=r"^module.distillation_tau=inf must be a finite number"):
        check_arguments(ModuleSettings, {"distillation_tau": float("inf")}, prefix="module.")
    check_arguments(ModuleSettings, {"distillation_tau": 3.0}, prefix="module.")
