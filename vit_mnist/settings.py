"""The schema of every setting of train, eval, predict and export, checked before any work.

Each entry point's settings are a tree of dataclasses. A field's type is its annotation;
its range, choices or own check sit beside it in the field's ``metadata`` (``_setting``);
this module is the one place where they are written, and :func:`check_settings` (a whole
config) and :func:`check_arguments` (a constructor called from Python, such as
``VisionTransformer``) are the one code that applies them. Keys that no dataclass declares
are refused by name with the nearest declared key. Sections that a library builds (each
with a ``_target_``) are also checked against the signature of that class, so
``+trainer.gradient_clip_val=1.0`` works and ``+trainer.gradient_clip=1.0`` is refused by
name. The defaults stay in ``configs/``: a field here is ``MISSING`` and says only what a
value may be.

Combinations that need more than one value, or the machine (patch size against image
size, heads against width, the model against the dataset, the batch against the dataset,
precision against the device), are checked after this: the model's in
``vit_mnist.models.checks``, the run's in ``vit_mnist.train.check_config``.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from vit_mnist.errors import ConfigError

# The speed paths' names, as ``speed.path`` takes them (with ``auto``): the keys of
# :data:`vit_mnist.speed.choose.PATHS`, which reads them here.
PATH_NAMES = ("reference", "fused", "handwritten", "compile", "native")
PRECISIONS = ["32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "64-true"]
# Apple's MPS is not among them: the speed paths are timed and tested on CPUs and CUDA only.
ACCELERATORS = ["auto", "cpu", "gpu", "cuda"]
# What a hyper-parameter search (configs/hparams_search/) may optimise, and which way:
# validation figures only, so that the test set stays unseen until a recipe is chosen.
SEARCH_METRICS = {"val/acc_best": "maximize", "val/acc": "maximize", "val/loss": "minimize"}


def _setting(
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: Sequence[Any] | None = None,
    check: Callable[[Any], str | None] | None = None,
    each: bool = False,
    length: int | None = None,
    example: str | None = None,
) -> Any:
    """A field whose value comes from the YAML; ``metadata`` holds what it may be.

    ``each``: the bounds apply to every item of a list. ``check``: a function of the value
    that returns what is wrong, or None. ``example``: a valid ``key=value`` for the fix.
    """
    meta = dict(ge=ge, gt=gt, le=le, lt=lt, choices=choices, check=check, each=each)
    return field(default=MISSING, metadata={**meta, "length": length, "example": example})


def _positive_ints(value: Any) -> str | None:
    items = value if isinstance(value, (list, tuple)) else [value]
    if all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in items):
        return None
    return "must be a positive integer, or one per block such as [2, 4, 4, 8]"


def _batches(value: Any) -> str | None:
    # Lightning: an int is a number of batches, a float a fraction of the epoch.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "must be a number of batches (int) or a fraction of the epoch (float)"
    if isinstance(value, float) and not 0.0 <= value <= 1.0:
        return "as a fraction of the epoch must be in [0, 1]; a number of batches is an int"
    if value < 0:
        return "must be >= 0"
    return None


def _devices(value: Any) -> str | None:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return None
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return None
    return "must be auto, a number of devices >= 1, or a list of device indices"


def _precision(value: Any) -> str | None:
    if value is None or str(value) in ["auto", *PRECISIONS]:
        return None
    return f"is not a precision; use one of {['auto', *PRECISIONS]}"


def _images(value: Any) -> str | None:
    if isinstance(value, str) or (
        isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value)
    ):
        return None
    return "must be a file, a folder, or a list of them: images=digit.png or images=[a.png,b.png]"


def _pictures(value: Any) -> str | None:
    if value == "all" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return None
    return "must be a number of images >= 0 (the first ones get pictures) or all"


@dataclass
class SpeedSettings:
    path: str = _setting(choices=["auto", *PATH_NAMES], example="speed.path=auto")
    compile: bool = _setting()


# MNIST digits are size-normalised into a 20 x 20 box centred in the 28 x 28 frame (LeCun
# et al., the MNIST page), leaving 4 pixels on each side: a test-time shift of at most 4
# keeps the whole digit inside the frame; more pushes strokes out and averages copies
# that are mostly border (issue 55: 98.4% reported as 12.7% at 100 pixels).
MAX_TEST_TIME_SHIFT = 4


def _test_time_shift(key: str) -> Any:
    return _setting(ge=0, le=MAX_TEST_TIME_SHIFT, example=f"{key}=1")


def _seed(key: str = "seed", below: int = 2**32) -> Any:
    # seed_everything seeds numpy too, whose seeds are < 2**32; a torch.Generator (the data
    # splits) takes any 64-bit seed.
    return _setting(ge=0, lt=below, example=f"{key}=1")


def _rate(key: str) -> Any:
    """A probability that must leave something: dropout 1 would zero everything."""
    return _setting(ge=0, lt=1, example=f"{key}=0.1")


@dataclass
class ModelSettings:
    """``VisionTransformer``'s arguments (vit_mnist/models/vit.py), or with ``arch=cnn`` the
    convnet teacher's (vit_mnist/models/cnn.py). Their constructors check them here
    (:func:`check_arguments`); ``patch_size`` dividing ``img_size`` and ``num_heads``
    dividing ``embed_dim`` are combinations (vit_mnist/models/checks.py)."""

    # The network: the Vision Transformer, or the convnet teacher of a distillation
    # (vit_mnist/models/cnn.py, which takes img_size, in_chans and num_classes only).
    arch: str = _setting(choices=["vit", "cnn"], example="model=cnn")
    img_size: int = _setting(ge=1, example="model.img_size=28")
    in_chans: int = _setting(ge=1, example="model.in_chans=1")
    num_classes: int = _setting(ge=2, example="model.num_classes=10")
    patch_size: int = _setting(ge=1, example="model.patch_size=7")
    embed_dim: int = _setting(ge=1, example="model.embed_dim=64")
    depth: int = _setting(ge=1, example="model.depth=6")
    num_heads: Any = _setting(check=_positive_ints, example="model.num_heads=4")
    head_dim: int | None = _setting(ge=1, example="model.head_dim=16")
    mlp_ratio: float = _setting(gt=0, example="model.mlp_ratio=2.0")
    dropout: float = _rate("model.dropout")
    attn_dropout: float = _rate("model.attn_dropout")
    # "auto" is what checkpoints of earlier versions stored: it runs the explicit path.
    attention_impl: str = _setting(
        choices=["explicit", "fused", "auto"], example="model.attention_impl=explicit"
    )
    causal: bool = _setting()
    qkv_bias: bool = _setting()
    drop_path_rate: float = _rate("model.drop_path_rate")
    distillation: bool = _setting()
    stem: str = _setting(choices=["patch", "conv"], example="model.stem=conv")
    stem_channels: list[int] = _setting(ge=1, each=True, example="model.stem_channels=[32,64]")


@dataclass
class ModuleSettings:
    """``ViTClassifier``'s optimiser and loss (vit_mnist/module.py), checked here by its
    constructor too."""

    _target_: str = _setting()
    lr: float = _setting(gt=0, example="module.lr=2e-3")
    weight_decay: float = _setting(ge=0, example="module.weight_decay=0.05")
    betas: list[float] = _setting(
        ge=0, lt=1, each=True, length=2, example="module.betas=[0.9,0.999]"
    )
    warmup_epochs: float = _setting(ge=0, example="module.warmup_epochs=1")
    min_lr_ratio: float = _setting(ge=0, le=1, example="module.min_lr_ratio=0.01")
    # 1 would make every target uniform: nothing left to learn.
    label_smoothing: float = _setting(ge=0, lt=1, example="module.label_smoothing=0.1")
    test_time_shift: int = _test_time_shift("module.test_time_shift")
    teacher_ckpt: str | None = _setting(example="module.teacher_ckpt=PATH/best.ckpt")


@dataclass
class AugmentSettings:
    degrees: float = _setting(ge=0, le=180, example="data.augment.degrees=10")
    # A fraction of the image side, as torchvision's RandomAffine.
    translate: float = _setting(ge=0, le=1, example="data.augment.translate=0.1")
    scale: list[float] = _setting(gt=0, each=True, length=2, example="data.augment.scale=[0.9,1.1]")
    hflip: bool = _setting()
    erasing: float = _setting(ge=0, le=1, example="data.augment.erasing=0.25")
    elastic_alpha: float = _setting(ge=0, example="data.augment.elastic_alpha=34")
    elastic_sigma: float = _setting(gt=0, example="data.augment.elastic_sigma=4")


@dataclass
class DataSettings:
    """The data modules' arguments (vit_mnist/data/); each key is also checked against the
    chosen module's signature, so ``num_train`` is refused for MNIST. Sizes against the
    dataset (``batch_size``, ``val_size``) are checked by the data module."""

    _target_: str = _setting()
    data_dir: str | None = _setting()
    batch_size: int = _setting(ge=1, example="data.batch_size=256")
    num_workers: int = _setting(ge=0, example="data.num_workers=2")
    val_size: int = _setting(ge=1, example="data.val_size=5000")
    split_seed: int = _seed("data.split_seed", below=2**64)
    download: bool = _setting()
    # Of the pixel values, which are in [0, 1]: so is their mean, and their standard
    # deviation is at most 0.5 (half the range, Popoviciu's inequality).
    mean: float = _setting(ge=0, le=1, example="data.mean=0.1307")
    std: float = _setting(gt=0, le=0.5, example="data.std=0.3081")
    pin_memory: bool = _setting()
    fast: bool = _setting()
    on_device: bool = _setting()
    augment: AugmentSettings | None = None
    num_train: int = _setting(ge=1, example="data.num_train=512")
    num_val: int = _setting(ge=1, example="data.num_val=128")
    num_test: int = _setting(ge=1, example="data.num_test=128")
    noise: float = _setting(ge=0, example="data.noise=1.0")
    seed: int = _seed("data.seed", below=2**64)


@dataclass
class TrainerSettings:
    """The ``lightning.pytorch.Trainer`` arguments our configs set; any other argument of
    the Trainer may be added (``+trainer.gradient_clip_val=1.0``) and is checked by name."""

    OPEN: ClassVar[bool] = True  # keys beyond these: any argument of the Trainer

    _target_: str = _setting()
    accelerator: str = _setting(choices=ACCELERATORS)
    devices: Any = _setting(check=_devices, example="trainer.devices=1")
    num_nodes: int = _setting(ge=1)
    strategy: Any = _setting()
    min_epochs: int | None = _setting(ge=0)
    max_epochs: int = _setting(ge=1, example="trainer.max_epochs=20")
    precision: Any = _setting(check=_precision)
    check_val_every_n_epoch: int | None = _setting(
        ge=1, example="trainer.check_val_every_n_epoch=1"
    )
    log_every_n_steps: int = _setting(ge=1, example="trainer.log_every_n_steps=50")
    limit_train_batches: Any = _setting(check=_batches, example="trainer.limit_train_batches=10")
    limit_val_batches: Any = _setting(check=_batches, example="trainer.limit_val_batches=10")
    limit_test_batches: Any = _setting(check=_batches, example="trainer.limit_test_batches=10")
    gradient_clip_val: float | None = _setting(ge=0, example="+trainer.gradient_clip_val=1.0")
    accumulate_grad_batches: int = _setting(ge=1, example="+trainer.accumulate_grad_batches=2")


@dataclass
class LastCheckpointSettings:
    """``callbacks.last_checkpoint`` (configs/callbacks/last_checkpoint.yaml), a
    ``ModelCheckpoint`` whose other arguments are checked by name."""

    OPEN: ClassVar[bool] = True

    # Lightning takes 0 as "never"; this callback exists only to write every N steps.
    every_n_train_steps: int | None = _setting(
        ge=1, example="callbacks.last_checkpoint.every_n_train_steps=100"
    )


@dataclass
class ModelCheckpointSettings:
    """``callbacks.model_checkpoint`` (configs/callbacks/model_checkpoint.yaml), the best
    checkpoint's ``ModelCheckpoint``, whose other arguments are checked by name."""

    OPEN: ClassVar[bool] = True

    # A name the module does not log stops Lightning only after the first validation.
    monitor: str | None = _setting(
        choices=[None, *SEARCH_METRICS, "train/acc", "train/loss"],
        example="callbacks.model_checkpoint.monitor=val/acc",
    )
    mode: str = _setting(choices=["min", "max"], example="callbacks.model_checkpoint.mode=max")


@dataclass
class CallbacksSettings:
    """The callbacks by name (configs/callbacks/); any other may be added."""

    OPEN: ClassVar[bool] = True

    last_checkpoint: LastCheckpointSettings | None = None
    model_checkpoint: ModelCheckpointSettings | None = None


@dataclass
class TrainSettings:
    """``python train.py`` (configs/train.yaml)."""

    task_name: str = _setting()
    seed: int = _seed()
    test: bool = _setting()
    ckpt_path: str | None = _setting()
    init_from: str | None = _setting()
    optimized_metric: str | None = _setting(
        choices=[None, *SEARCH_METRICS], example="optimized_metric=val/acc_best"
    )
    speed: SpeedSettings = field(default_factory=SpeedSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    module: ModuleSettings = field(default_factory=ModuleSettings)
    data: DataSettings = field(default_factory=DataSettings)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    callbacks: CallbacksSettings | None = None
    logger: dict[str, Any] | None = None
    paths: dict[str, Any] = field(default_factory=dict)


@dataclass
class FaithfulnessSettings:
    num_images: int = _setting(ge=1, example="faithfulness.num_images=1000")
    seed: int = _seed("faithfulness.seed")


@dataclass
class PruneSettings:
    """``eval.py analysis=prune`` and :func:`vit_mnist.analysis.pruning.prune_iteratively`."""

    step_fraction: float = _setting(gt=0, le=1, example="prune.step_fraction=0.1")
    # Each block keeps one head, so all heads (1) can never be removed; 0 removes none.
    max_fraction: float = _setting(gt=0, lt=1, example="prune.max_fraction=0.75")
    normalise: bool = _setting()


def _class_pairs(value: Any) -> str | None:
    def is_class(c: Any) -> bool:
        return isinstance(c, int) and not isinstance(c, bool) and c >= 0

    if value is None or (
        isinstance(value, (list, tuple))
        and value
        and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(map(is_class, p)) and p[0] != p[1]
            for p in value
        )
    ):
        return None
    return (
        "must be null (the checkpoint's most confused pairs) or a list of [clean, corrupted] "
        "pairs of two different classes, such as [[4,9],[7,2]]"
    )


@dataclass
class CircuitsSettings:
    """``eval.py analysis=circuits``: direct logit attribution, the logit lens, and
    activation patching between pairs of classes."""

    num_pairs: int = _setting(ge=1, example="circuits.num_pairs=3")
    pairs: Any = _setting(check=_class_pairs, example="circuits.pairs=[[4,9],[7,2]]")
    pair_images: int = _setting(ge=1, example="circuits.pair_images=50")


@dataclass
class EvalSettings:
    """``python eval.py`` (configs/eval.yaml)."""

    task_name: str = _setting()
    seed: int = _seed()
    ckpt_path: str = _setting(example="ckpt_path=latest")
    analysis: str | None = _setting(
        choices=[None, "heads", "faithfulness", "prune", "roles", "circuits"]
    )
    split: str = _setting(choices=["test", "val"])
    test_time_shift: int | None = _test_time_shift("test_time_shift")
    faithfulness: FaithfulnessSettings = field(default_factory=FaithfulnessSettings)
    precision: Any = _setting(check=_precision)
    prune: PruneSettings = field(default_factory=PruneSettings)
    circuits: CircuitsSettings = field(default_factory=CircuitsSettings)
    data: DataSettings | None = None
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    logger: dict[str, Any] | None = None
    paths: dict[str, Any] = field(default_factory=dict)


@dataclass
class PredictSettings:
    """``python scripts/predict.py`` (configs/predict.yaml)."""

    task_name: str = _setting()
    ckpt_path: str = _setting(example="ckpt_path=latest")
    images: Any = _setting(check=_images)
    pictures: Any = _setting(check=_pictures, example="pictures=64")
    resume: bool = _setting()
    paths: dict[str, Any] = field(default_factory=dict)


# scripts/export.py's formats and the file suffix each writes.
EXPORT_FORMATS = {"onnx": ".onnx", "torchscript": ".pt"}


@dataclass
class ExportSettings:
    """``python scripts/export.py`` (configs/export.yaml)."""

    task_name: str = _setting()
    ckpt_path: str = _setting(example="ckpt_path=latest")
    format: str = _setting(choices=list(EXPORT_FORMATS))
    output: str | None = _setting()
    overwrite: bool = _setting()
    opset: int = _setting(ge=7, example="opset=18")
    check_images: int = _setting(ge=1, example="check_images=1000")
    data: DataSettings | None = None
    paths: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExploreSettings:
    """``python scripts/explore.py`` (configs/explore.yaml)."""

    task_name: str = _setting()
    ckpt_path: str = _setting(example="ckpt_path=latest")
    heads_csv: str | None = _setting(example="heads_csv=<eval run>/head_importance.csv")
    server_name: str = _setting(example="server_name=127.0.0.1")
    server_port: int | None = _setting(ge=1, le=65535, example="server_port=7860")
    max_upload_mb: float = _setting(gt=0, example="max_upload_mb=10")
    max_upload_megapixels: float = _setting(gt=0, example="max_upload_megapixels=25")
    data: DataSettings | None = None
    paths: dict[str, Any] = field(default_factory=dict)


# The settings of each command, by the name of its function in vit_mnist.cli.
SETTINGS: dict[str, type] = {
    "train": TrainSettings,
    "evaluate": EvalSettings,
    "predict": PredictSettings,
    "export": ExportSettings,
    "explore": ExploreSettings,
}

# Keys of earlier versions, and what replaced them.
RETIRED: dict[str, str] = {
    "model.compile": (
        "is no longer a model setting: torch.compile is one of the speed paths; use "
        "speed.path=compile (or speed.compile=true, with which speed.path=auto times it too)"
    ),
    "speed.cache": "is gone: speed.path=auto times the paths afresh in every run; drop it",
    "hydra.sweeper.direction": (
        "is gone: an Optuna study's direction is its optimized_metric's (val/loss is "
        "minimised, the accuracies maximised); drop it"
    ),
}

# Hydra instantiation keys, not arguments of the target.
_HYDRA_KEYS = {"_target_", "_partial_", "_args_", "_recursive_", "_convert_"}


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return "null" if value is None else str(value)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The field annotations of a settings class, as types (the module has string ones)."""
    return typing.get_type_hints(cls)


def _dataclass_of(annotation: Any) -> type | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if is_dataclass(candidate):
            return candidate
    return None


def _section(schema: type, section: str) -> type | None:
    """The settings class of a dotted ``section`` ('' for the top); None if undeclared."""
    cls: type | None = schema
    for part in filter(None, section.split(".")):
        if cls is None or part not in _hints(cls):
            return None
        cls = _dataclass_of(_hints(cls)[part])
    return cls


def known_keys(schema: type, section: str) -> list[str]:
    """The keys that ``section`` (dotted, '' for the top) of ``schema`` declares."""
    cls = _section(schema, section)
    return [f.name for f in fields(cls)] if cls is not None else []


def is_open(schema: type, section: str) -> bool:
    """Whether ``section`` takes keys that the schema does not declare: any argument of the
    class its ``_target_`` names (``+trainer.gradient_clip_val=1.0``), checked by name."""
    parent, _, name = section.rpartition(".")
    cls = _section(schema, parent)
    if cls is None or name not in _hints(cls):
        return False
    annotation = _hints(cls)[name]
    sub = _dataclass_of(annotation)
    if sub is None:  # a free dict such as callbacks, logger
        return dict in (annotation, *typing.get_args(annotation), typing.get_origin(annotation))
    return getattr(sub, "OPEN", False)


def unknown_key(
    key: str, schema: type, value: str | None = None, candidates: Sequence[str] | None = None
) -> str:
    """The one line for a ``key`` that ``schema`` does not declare: what replaced it, or the
    nearest key of its section ("did you mean"), or the keys there.

    ``value``: the value the user gave, for the example. ``candidates``: the names to
    compare with (default: the section's keys in the schema).
    """
    if key in RETIRED:
        return f"{key} {RETIRED[key]}"
    section, _, name = key.rpartition(".")
    if candidates is None:
        candidates = known_keys(schema, section)
    where = f"a setting of {section}" if section else "a top-level setting"
    close = difflib.get_close_matches(name, list(candidates), n=1)
    # An open section's class may take the key although the schema does not declare it.
    open_section = bool(section) and value is not None and is_open(schema, section.split(".")[0])
    if close:
        nearest = f"{section}.{close[0]}" if section else close[0]
        if value is None:
            return f"{key} is not {where}; did you mean {nearest}?"
        plus = f", or +{nearest}={value} where the config does not set it yet"
        plus = plus if open_section else ""
        return f"{key} is not {where}; did you mean {nearest}? ({nearest}={value}{plus})"
    if open_section:
        return (
            f"{key} is not in the config; to pass one more argument to {section}'s class, "
            f"add it with a +: +{key}={value}"
        )
    listed = ", ".join(sorted(c for c in candidates if not c.startswith("_") and c != "self"))
    return f"{key} is not {where} (the settings there: {listed})"


def _kind(annotation: Any) -> str:
    """What a value of this type is, in words, for the error."""
    for kind, words in (
        (bool, "true or false"),
        (int, "a whole number"),
        (float, "a number"),
        (str, "a string"),
    ):
        if annotation is kind:
            return words
    if typing.get_origin(annotation) is list:
        return "a list of numbers, such as [0.9,0.999]"
    return "a section of keys and values"


def _has_type(annotation: Any, value: Any) -> bool:
    """Whether ``value`` (plain Python, as YAML and the command line give) has the type."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(a, value) for a in typing.get_args(annotation))
    if annotation is Any:
        return True
    if annotation is type(None):
        return value is None
    if annotation in (int, float) and isinstance(value, bool):
        return False
    if annotation is float:
        return isinstance(value, (int, float))
    if origin is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, (list, tuple)) and all(_has_type(item, v) for v in value)
    if origin is dict or is_dataclass(annotation):
        return isinstance(value, dict)
    return isinstance(value, annotation)


def _fix(meta: Any) -> str:
    return f"; e.g. {meta['example']}" if meta.get("example") else ""


def _check_value(key: str, value: Any, annotation: Any, meta: Any) -> None:
    """Type, then the field's own check, choices, length and bounds (its ``metadata``)."""
    if not _has_type(annotation, value):
        # Of ``int | None``, the int.
        kinds = [a for a in (*typing.get_args(annotation), annotation) if a is not type(None)]
        kind = _kind(kinds[0])
        raise ConfigError(f"{key}={_show(value)} must be {kind}{_fix(meta)}")
    if value is None:
        return
    if meta.get("check") is not None:
        problem = meta["check"](value)
        if problem:
            raise ConfigError(f"{key}={_show(value)} {problem}{_fix(meta)}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        shown = [_show(c) for c in choices]
        raise ConfigError(f"{key}={_show(value)} is not one of {shown}")
    if meta.get("length") is not None and len(value) != meta["length"]:
        raise ConfigError(f"{key}={_show(value)} must have {meta['length']} values{_fix(meta)}")
    items = value if meta.get("each") else [value]
    tests = {"ge": float.__ge__, "gt": float.__gt__, "le": float.__le__, "lt": float.__lt__}
    for v in items:
        if all(meta.get(b) is None or tests[b](float(v), float(meta[b])) for b in tests):
            continue
        what = ": each value" if meta.get("each") else ""
        raise ConfigError(f"{key}={_show(value)}{what} must be {_range(meta)}{_fix(meta)}")


def _range(meta: Any) -> str:
    """``in [0, 1)``, ``>= 1`` or ``< 1`` from the field's bounds."""

    def show(limit: float) -> str:
        return f"2**{int(limit).bit_length() - 1}" if limit >= 2**16 else _show(limit)

    low = ("[", meta["ge"]) if meta.get("ge") is not None else ("(", meta.get("gt"))
    high = ("]", meta["le"]) if meta.get("le") is not None else (")", meta.get("lt"))
    if low[1] is not None and high[1] is not None:
        return f"in {low[0]}{show(low[1])}, {show(high[1])}{high[0]}"
    if low[1] is not None:
        return f"{'>=' if low[0] == '[' else '>'} {show(low[1])}"
    return f"{'<=' if high[0] == ']' else '<'} {show(high[1])}"


def _walk(cls: type, values: dict[str, Any], prefix: str, schema: type) -> None:
    """Every key of ``values`` declared by ``cls`` (or, in an open section, left to
    :func:`_check_target`), every value of its type and in its range."""
    hints = _hints(cls)
    for name, value in values.items():
        key = f"{prefix}{name}"
        if name not in hints:
            if getattr(cls, "OPEN", False):
                continue
            target_args = _target_args(values) if prefix else []
            names = [*known_keys(cls, ""), *target_args]
            raise ConfigError(unknown_key(key, schema, candidates=names))
        annotation = hints[name]
        sub = _dataclass_of(annotation)
        meta = cls.__dataclass_fields__[name].metadata
        if sub is not None and isinstance(value, dict):
            _walk(sub, value, key + ".", schema)
        else:
            _check_value(key, value, annotation, meta)


def check_arguments(section: type, values: dict[str, Any], prefix: str = "") -> None:
    """Check keyword arguments against one section of the schema (e.g. ``ModelSettings``),
    for a constructor that is also called from Python, not only from a config.

    Raises:
        ConfigError: the first key that is undeclared, of the wrong type or out of range,
            named as ``prefix + key``.
    """
    _walk(section, values, prefix, section)


def import_target(target: str) -> Any:
    """The object a dotted ``_target_`` path names, as Hydra's ``instantiate`` finds it.

    Raises ImportError naming the first part of the path that does not exist. (Hydra's own
    ``get_object`` also logs an ERROR over several lines, before the one-line message.)
    """
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            found = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is not None and module_name.startswith(e.name):
                continue  # this prefix is not a module: try a shorter one
            raise  # the module exists but imports something that does not
        for depth, attr in enumerate(parts[i:], start=i):
            if not hasattr(found, attr):
                raise ImportError(f"{'.'.join(parts[:depth])} has no {attr!r}")
            found = getattr(found, attr)
        return found
    raise ImportError(f"no module named {parts[0]!r}")


def _target_parameters(target: str) -> Any:
    """The parameters of the class or function a ``_target_`` names (None when it has no
    signature); ImportError (from :func:`import_target`) for a path that does not exist."""
    found = import_target(target)
    try:
        return inspect.signature(found).parameters
    except (TypeError, ValueError):
        return None


def _check_target(key: str, node: Any) -> None:
    """Every key of an instantiated section must be an argument of its ``_target_``."""
    if not isinstance(node, dict) or "_target_" not in node:
        return
    try:
        params = _target_parameters(node["_target_"])
    except Exception as e:  # noqa: BLE001 - importing a module on the path can raise anything
        raise ConfigError(
            f"{key}._target_={node['_target_']} cannot be imported ({' '.join(str(e).split())}); "
            "check its spelling"
        ) from None
    if params is None:
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for name, value in node.items():
        if name in _HYDRA_KEYS:
            continue
        if name not in params:
            names = [p for p in params if p != "self"]
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {key}.{close[0]}?" if close else ""
            listed = f"its arguments: {', '.join(names)}" if len(names) <= 15 else "see its docs"
            raise ConfigError(
                f"{key}.{name} is not an argument of {node['_target_']}{hint} ({listed})"
            )
        if isinstance(value, list):
            for i, item in enumerate(value):
                _check_target(f"{key}.{name}[{i}]", item)
        else:
            _check_target(f"{key}.{name}", value)


def check_settings(cfg: DictConfig, schema: type, targets: bool = True) -> dict[str, Any]:
    """Check every key of ``cfg`` against ``schema`` (one of the ``*Settings`` classes).

    Order: interpolations resolve; every key is declared (or, in an open section such as
    ``trainer``, an argument of its ``_target_``); every value has its declared type and is
    in its range or among its choices; with ``targets``, every section with a ``_target_``
    (``trainer``, ``data``, ``module``, each callback and logger) takes only arguments of
    that class, which imports it (torch, Lightning: seconds; without, no torch is needed).

    Returns:
        The resolved settings as plain Python values.

    Raises:
        ConfigError: one line naming the key, the value and a valid example.
    """
    try:
        values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:
        key = e.full_key or "a setting"
        raise ConfigError(
            f"{key} is required; set it on the command line, e.g. {key}=..."
        ) from None
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "") or "a setting"
        raise ConfigError(f"{key}: {' '.join(str(e).split())}") from None
    values.pop("hydra", None)
    check_arguments(schema, values)
    if not targets:
        return values
    for section, sub in values.items():
        if isinstance(sub, dict) and "_target_" not in sub:  # callbacks, logger: named parts
            for name, item in sub.items():
                _check_target(f"{section}.{name}", item)
        else:
            _check_target(section, sub)
    return values


def _target_args(node: dict[str, Any]) -> list[str]:
    """The arguments of ``node``'s ``_target_``, for a "did you mean"; [] without one."""
    try:
        return list(_target_parameters(node["_target_"]) or []) if "_target_" in node else []
    except Exception:  # noqa: BLE001 - only for the hint
        return []


__all__ = [
    "EvalSettings",
    "ExploreSettings",
    "ExportSettings",
    "PredictSettings",
    "RETIRED",
    "SETTINGS",
    "TrainSettings",
    "check_arguments",
    "check_settings",
    "import_target",
    "is_open",
    "known_keys",
    "unknown_key",
]
