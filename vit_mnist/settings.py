"""The schema of every setting of train, eval, predict, export and explore, checked before
any work.

Each entry point's settings are a tree of pydantic (v2) models: a field's type, range
(``Field(ge=..., lt=...)``), choices (``Literal``) and example (``Field(examples=[...])``)
are written here once (the model, module and data sections take their names and types from
the constructors' signatures, :func:`built_from`), and pydantic checks them, strictly
(``"1"`` is not a number, ``1.5`` not a whole number) and refusing undeclared keys. This
module only turns pydantic's first error, told apart by its error ``type``, into the
project's one line naming the key, the value and the fix, and adds what pydantic cannot
know: the nearest declared key for an unknown one, and, for a section built by a library
(with a ``_target_``), that every key is an argument of that class
(``+trainer.gradient_clip_val=1.0`` passes, ``+trainer.gradient_clip=1.0`` does not). The
defaults stay in ``configs/``: a key the config leaves out is not checked.

Combinations that need more than one value or the machine (patch size against image size,
heads against width, the model against the dataset, the batch against the dataset,
precision against the device) are checked after this: the model's in
``vit_mnist.models.checks``, a training run's in ``vit_mnist.training.checks.check_run``.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model

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
# MNIST digits are size-normalised into a 20 x 20 box centred in the 28 x 28 frame (LeCun
# et al., the MNIST page), leaving 4 pixels on each side: a test-time shift of at most 4
# keeps the whole digit inside the frame (issue 55: 98.4% reported as 12.7% at 100 pixels).
MAX_TEST_TIME_SHIFT = 4
# scripts/export.py's formats and the file suffix each writes: ONNX, a torch.export program
# (the format PyTorch recommends for deployment) and TorchScript (deprecated by PyTorch).
EXPORT_FORMATS = {"onnx": ".onnx", "exported": ".pt2", "torchscript": ".pt"}
# ``eval.py analysis=prune``'s orders: what ranks the heads for removal (the measures of
# vit_mnist.analysis.pruning.MEASURES, which reads them here).
PRUNE_ORDERS = ("gradient", "ablation", "logit_attribution", "patching", "random")


def _f(example: str | None = None, **bounds: float) -> Any:
    """A field the YAML sets (None: left out, not checked), with its bounds and example."""
    return Field(None, examples=[example] if example else None, **bounds)


def _checked(problem: Callable[[Any], str | None]) -> Any:
    """The type of a value that ``problem(value)`` checks: what is wrong, or None."""

    def check(value: Any) -> Any:
        if said := problem(value):
            raise ValueError(said)
        return value

    return Annotated[Any, AfterValidator(check)]


def _is_count(v: Any, least: int = 1) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


@_checked
def Heads(v: Any) -> str | None:  # noqa: N802 - a type, named as one
    if not all(map(_is_count, v if isinstance(v, list) else [v])):
        return "must be a positive integer, or one per block such as [2, 4, 4, 8]"


@_checked
def PruneOrders(v: Any) -> str | None:  # noqa: N802
    if not isinstance(v, list) or not v:
        return f"must be a non-empty list of orders from {list(PRUNE_ORDERS)}"
    unknown = [o for o in v if o not in PRUNE_ORDERS]
    if unknown:
        return f"names {', '.join(map(str, unknown))}: the orders are {list(PRUNE_ORDERS)}"
    if len(set(v)) < len(v):
        return "names an order twice; give each once"


@_checked
def Devices(v: Any) -> str | None:  # noqa: N802
    if not (
        v == "auto" or _is_count(v) or isinstance(v, list) and all(map(_is_count, v, [0] * len(v)))
    ):
        return "must be auto, a number of devices >= 1, or a list of device indices"


@_checked
def Precision(v: Any) -> str | None:  # noqa: N802
    if v is not None and str(v) not in ["auto", *PRECISIONS]:
        return f"is not a precision; use one of {['auto', *PRECISIONS]}"


@_checked
def Batches(v: Any) -> str | None:  # noqa: N802
    # Lightning: an int is a number of batches, a float a fraction of the epoch, None all.
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return "must be a number of batches (int) or a fraction of the epoch (float)"
    if isinstance(v, float) and not 0.0 <= v <= 1.0:
        return "as a fraction of the epoch must be in [0, 1]; a number of batches is an int"
    return "must be >= 0" if v < 0 else None


@_checked
def Images(v: Any) -> str | None:  # noqa: N802
    if not (isinstance(v, str) or isinstance(v, list) and v and all(isinstance(i, str) for i in v)):
        return (
            "must be a file, a folder, or a list of them: images=digit.png or images=[a.png,b.png]"
        )


@_checked
def Pictures(v: Any) -> str | None:  # noqa: N802
    if v != "all" and not _is_count(v, 0):
        return "must be a number of images >= 0 (the first ones get pictures) or all"


@_checked
def ClassPairs(v: Any) -> str | None:  # noqa: N802
    pairs = v if isinstance(v, list) and v else [None]
    if v is not None and not all(
        isinstance(p, list) and len(p) == 2 and p[0] != p[1] and all(_is_count(c, 0) for c in p)
        for p in pairs
    ):
        return (
            "must be null (the checkpoint's most confused pairs) or a list of [clean, "
            "corrupted] pairs of two different classes, such as [[4,9],[7,2]]"
        )


def _seed(key: str = "seed", below: int = 2**32) -> Any:
    # seed_everything seeds numpy too, whose seeds are < 2**32; a torch.Generator (the data
    # splits) takes any 64-bit seed.
    return _f(f"{key}=1", ge=0, lt=below)


def _rate(key: str) -> Any:
    """A probability that must leave something: dropout 1 would zero everything."""
    return _f(f"{key}=0.1", ge=0, lt=1)


def _shift(key: str) -> Any:
    return _f(f"{key}=1", ge=0, le=MAX_TEST_TIME_SHIFT)


class Section(BaseModel):
    """A section of settings: only declared keys, each of its type, strictly."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class Built(Section):
    """A section a library builds from its ``_target_`` (Hydra's ``instantiate``)."""

    target: str = Field(None, alias="_target_")


class OpenBuilt(Built):
    """A built section that takes any other argument of its ``_target_``, checked by name."""

    model_config = ConfigDict(extra="allow")


class SpeedSettings(Section):
    path: Literal[("auto", *PATH_NAMES)] = _f("speed.path=auto")
    compile: bool = _f()
    remeasure: bool = _f()


class AugmentSettings(Section):
    degrees: float = _f("data.augment.degrees=10", ge=0, le=180)
    # A fraction of the image side, as torchvision's RandomAffine.
    translate: float = _f("data.augment.translate=0.1", ge=0, le=1)
    scale: list[Annotated[float, Field(gt=0)]] = Field(
        None, min_length=2, max_length=2, examples=["data.augment.scale=[0.9,1.1]"]
    )
    hflip: bool = _f()
    erasing: float = _f("data.augment.erasing=0.25", ge=0, le=1)
    elastic_alpha: float = _f("data.augment.elastic_alpha=34", ge=0)
    elastic_sigma: float = _f("data.augment.elastic_sigma=4", gt=0)


# ------------------------------------------------- sections built from the project's classes
# The model, the module and the data sections take the arguments of the project's own
# classes: their names and types are read from the constructors' signatures (section
# :func:`built_from`), so that a new argument is written once, in its class. Only what a
# signature cannot state is added here: each argument's range or choices and example.

# The networks ``model.arch`` chooses between, by the class's dotted name.
MODEL_CLASSES = {
    "vit": "vit_mnist.models.vit.VisionTransformer",
    "cnn": "vit_mnist.models.cnn.ConvNet",
}
MODULE_CLASS = "vit_mnist.training.module.ViTClassifier"
# The data modules the configs name (configs/data/); FashionMNISTDataModule takes MNIST's.
DATA_MODULES = (
    "vit_mnist.data.mnist.MNISTDataModule",
    "vit_mnist.data.synthetic.SyntheticDataModule",
)

# Settings of a built section that are no constructor's argument (model.arch chooses the
# constructor): any other range without its argument is an error in the schema.
NOT_ARGUMENTS = {"arch"}
# A conv stem of no convolution would be the patch stem under another name: at least one.
_Positive = Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1)] | None
MODEL_RANGES: dict[str, Any] = {
    # Not a constructor argument: which constructor (build_model).
    "arch": (Literal[tuple(MODEL_CLASSES)], _f("model=cnn")),
    "img_size": _f("model.img_size=28", ge=1),
    "in_chans": _f("model.in_chans=1", ge=1),
    "num_classes": _f("model.num_classes=10", ge=2),
    "patch_size": _f("model.patch_size=7", ge=1),
    "embed_dim": _f("model.embed_dim=64", ge=1),
    "depth": _f("model.depth=6", ge=1),
    "num_heads": (Heads, _f("model.num_heads=4")),
    "head_dim": _f("model.head_dim=16", ge=1),
    "mlp_ratio": _f("model.mlp_ratio=2.0", gt=0),
    "dropout": _rate("model.dropout"),
    "attn_dropout": _rate("model.attn_dropout"),
    # "auto" is what checkpoints of earlier versions stored: it runs the explicit path.
    "attention_impl": (Literal["explicit", "fused", "auto"], _f("model.attention_impl=explicit")),
    "drop_path_rate": _rate("model.drop_path_rate"),
    "stem": (Literal["patch", "conv"], _f("model.stem=conv")),
    "stem_channels": (_Positive, _f("model.stem_channels=[32,64]")),
    "stem_strides": (_Positive, _f("model.stem_strides=[2,1,2,1]")),
}
MODULE_RANGES: dict[str, Any] = {
    "lr": _f("module.lr=2e-3", gt=0),
    "weight_decay": _f("module.weight_decay=0.05", ge=0),
    "betas": (
        list[Annotated[float, Field(ge=0, lt=1)]],
        Field(None, min_length=2, max_length=2, examples=["module.betas=[0.9,0.999]"]),
    ),
    "warmup_epochs": _f("module.warmup_epochs=1", ge=0),
    "min_lr_ratio": _f("module.min_lr_ratio=0.01", ge=0, le=1),
    "schedule_epochs": _f("module.schedule_epochs=27", gt=0),
    # 1 would make every target uniform: nothing left to learn.
    "label_smoothing": _f("module.label_smoothing=0.1", ge=0, lt=1),
    "test_time_shift": _shift("module.test_time_shift"),
    "teacher_ckpt": _f("module.teacher_ckpt=PATH/best.ckpt"),
    # inf would soften every output to uniform (and the loss, times tau**2, to NaN).
    "distillation_tau": _f("module.distillation_tau=3", gt=0, allow_inf_nan=False),
}
DATA_RANGES: dict[str, Any] = {
    "data_dir": (str | None, _f()),
    "batch_size": _f("data.batch_size=256", ge=1),
    "num_workers": _f("data.num_workers=2", ge=0),
    "val_size": _f("data.val_size=5000", ge=1),
    "split_seed": _seed("data.split_seed", below=2**64),
    # Of the pixel values, which are in [0, 1]: so is their mean, and their standard
    # deviation is at most 0.5 (half the range, Popoviciu's inequality).
    "mean": _f("data.mean=0.1307", ge=0, le=1),
    "std": _f("data.std=0.3081", gt=0, le=0.5),
    "augment": (AugmentSettings | None, None),
    "num_train": _f("data.num_train=512", ge=1),
    "num_val": _f("data.num_val=128", ge=1),
    "num_test": _f("data.num_test=128", ge=1),
    "noise": _f("data.noise=1.0", ge=0),
    "seed": _seed("data.seed", below=2**64),
}


def _source_file(module: str) -> Path:
    """The file of ``module`` (a dotted name in this package), found without importing it
    or its package (``vit_mnist.models`` imports torch)."""
    package, *parts = module.split(".")
    (root,) = importlib.util.find_spec(package).submodule_search_locations
    return Path(root, *parts).with_suffix(".py")


def constructor_arguments(target: str) -> dict[str, Any]:
    """The keyword arguments of the class ``target`` (dotted, such as
    ``"vit_mnist.models.vit.VisionTransformer"``) and their annotations, read from its
    ``__init__``'s signature in the source with ``ast``, so that checking the settings
    imports neither the class nor torch (the one-line error comes in about a second).

    Raises:
        LookupError: no such class, or one without an ``__init__`` of its own.
    """
    module, _, name = target.rpartition(".")
    tree = ast.parse(_source_file(module).read_text(encoding="utf-8"))
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    inits = [
        n
        for c in classes
        for n in c.body
        if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    ]
    if not inits:
        raise LookupError(f"{target}: no class with an __init__ of its own in {module}")
    args = inits[0].args
    # The annotations name builtins and what the module takes from the standard library's
    # typing modules (Sequence, Any): those are cheap to import, the rest is not needed.
    names = {
        alias.asname or alias.name: getattr(importlib.import_module(n.module), alias.name)
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and n.module in ("typing", "collections.abc")
        for alias in n.names
    }
    return {
        a.arg: eval(ast.unparse(a.annotation), names) if a.annotation else Any  # noqa: S307
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]
        if a.arg != "self"
    }


def built_from(
    name: str,
    targets: typing.Iterable[str],
    ranges: dict[str, Any],
    *,
    base: type = Section,
    leave_out: tuple[str, ...] = (),
    doc: str = "",
) -> type[Section]:
    """A section (pydantic's ``create_model``) whose fields are the keyword arguments of
    the classes ``targets`` (their union), each of its signature's type, with its range,
    choices and example from ``ranges`` (an argument: a ``Field``, or a ``(type, Field)``
    pair that narrows the type), and checked only where the YAML sets it; the arguments
    ``leave_out`` (passed by the code, not the config) are not settings.

    Raises:
        LookupError: a range for an argument that none of ``targets`` takes (a renamed
            argument whose range was left behind), unless :data:`NOT_ARGUMENTS` names it.
    """
    signature: dict[str, Any] = {}
    for target in targets:
        for arg, annotation in constructor_arguments(target).items():
            if arg not in leave_out:
                signature.setdefault(arg, annotation)
    stray = [k for k in ranges if k not in signature and k not in NOT_ARGUMENTS]
    if stray:
        raise LookupError(f"{name}: ranges for {stray}, which no constructor of {targets} takes")
    # A setting that is no argument (model.arch) first, then the signatures' order.
    fields = {k: v for k, v in ranges.items() if k not in signature}
    for arg, annotation in signature.items():
        given = ranges.get(arg, _f())
        fields[arg] = given if isinstance(given, tuple) else (annotation, given)
    return create_model(name, __base__=base, __doc__=doc, **fields)


ModelSettings = built_from(
    "ModelSettings",
    MODEL_CLASSES.values(),
    MODEL_RANGES,
    doc="""``VisionTransformer``'s arguments (vit_mnist/models/vit.py), or with ``arch=cnn`` the
    convnet teacher's (vit_mnist/models/cnn.py); ``patch_size`` dividing ``img_size`` and
    ``num_heads`` dividing ``embed_dim`` are combinations (vit_mnist/models/checks.py).""",
)
ModuleSettings = built_from(
    "ModuleSettings",
    [MODULE_CLASS],
    MODULE_RANGES,
    base=Built,
    leave_out=("model",),  # the model section, passed by train()
    doc="``ViTClassifier``'s optimiser and loss (vit_mnist/training/module.py).",
)
DataSettings = built_from(
    "DataSettings",
    DATA_MODULES,
    DATA_RANGES,
    base=Built,
    doc="""The data modules' arguments (vit_mnist/data/); each key is also checked against the
    chosen module's signature, so ``num_train`` is refused for MNIST. Sizes against the
    dataset (``batch_size``, ``val_size``) are checked by the data module.""",
)


class TrainerSettings(OpenBuilt):
    """The ``lightning.pytorch.Trainer`` arguments our configs set; any other argument of
    the Trainer may be added (``+trainer.gradient_clip_val=1.0``) and is checked by name."""

    accelerator: Literal[tuple(ACCELERATORS)] = _f()
    devices: Devices = _f("trainer.devices=1")
    num_nodes: int = _f(ge=1)
    strategy: Any = None
    min_epochs: int | None = _f(ge=0)
    max_epochs: int = _f("trainer.max_epochs=20", ge=1)
    precision: Precision = _f()
    check_val_every_n_epoch: int | None = _f("trainer.check_val_every_n_epoch=1", ge=1)
    log_every_n_steps: int = _f("trainer.log_every_n_steps=50", ge=1)
    limit_train_batches: Batches = _f("trainer.limit_train_batches=10")
    limit_val_batches: Batches = _f("trainer.limit_val_batches=10")
    limit_test_batches: Batches = _f("trainer.limit_test_batches=10")
    gradient_clip_val: float | None = _f("+trainer.gradient_clip_val=1.0", ge=0)
    accumulate_grad_batches: int = _f("+trainer.accumulate_grad_batches=2", ge=1)


class LastCheckpointSettings(OpenBuilt):
    """``callbacks.last_checkpoint``, a ``ModelCheckpoint`` that writes every N steps."""

    # Lightning takes 0 as "never"; this callback exists only to write every N steps.
    every_n_train_steps: int | None = _f("callbacks.last_checkpoint.every_n_train_steps=100", ge=1)


class ModelCheckpointSettings(OpenBuilt):
    """``callbacks.model_checkpoint``, the best checkpoint's ``ModelCheckpoint``."""

    # A name the module does not log stops Lightning only after the first validation.
    monitor: Literal[(None, *SEARCH_METRICS, "train/acc", "train/loss")] = _f(
        "callbacks.model_checkpoint.monitor=val/acc"
    )
    mode: Literal["min", "max"] = _f("callbacks.model_checkpoint.mode=max")


class EMASettings(OpenBuilt):
    """``callbacks.ema``, Lightning's ``EMAWeightAveraging`` (configs/callbacks/ema.yaml). A
    start after the run's last step is refused by ``ViTClassifier`` once the run's length
    is known."""

    # 1 would keep the weights the run started from; above 1 the average diverges.
    decay: float = _f("callbacks.ema.decay=0.999", ge=0, lt=1)
    # 0 never updates the average (Lightning takes it as "never").
    update_every_n_steps: int = _f("callbacks.ema.update_every_n_steps=1", ge=1)
    update_starting_at_step: int | None = _f("callbacks.ema.update_starting_at_step=100", ge=0)
    update_starting_at_epoch: int | None = _f("callbacks.ema.update_starting_at_epoch=1", ge=0)


class CallbacksSettings(Section):
    """The callbacks by name (configs/callbacks/); any other may be added."""

    model_config = ConfigDict(extra="allow")

    last_checkpoint: LastCheckpointSettings | None = None
    model_checkpoint: ModelCheckpointSettings | None = None
    ema: EMASettings | None = None


class TrainSettings(Section):
    """``python train.py`` (configs/train.yaml)."""

    task_name: str = _f()
    seed: int = _seed()
    test: bool = _f()
    ckpt_path: str | None = _f()
    init_from: str | None = _f()
    optimized_metric: Literal[(None, *SEARCH_METRICS)] = _f("optimized_metric=val/acc_best")
    speed: SpeedSettings = None
    model: ModelSettings = None
    module: ModuleSettings = None
    data: DataSettings = None
    trainer: TrainerSettings = None
    callbacks: CallbacksSettings | None = None
    logger: dict[str, Any] | None = None
    paths: dict[str, Any] = None


class FaithfulnessSettings(Section):
    num_images: int = _f("faithfulness.num_images=1000", ge=1)
    seed: int = _seed("faithfulness.seed")


class PruneSettings(Section):
    """``eval.py analysis=prune``: :mod:`vit_mnist.analysis.pruning`."""

    orders: PruneOrders = _f("prune.orders=[gradient,ablation]")
    step_fraction: float = _f("prune.step_fraction=0.1", gt=0, le=1)
    # Each block keeps one head, so all heads (1) can never be removed; 0 removes none.
    max_fraction: float = _f("prune.max_fraction=0.75", gt=0, lt=1)
    normalise: bool = _f()
    # Validation accuracy points; 100 takes the last step whatever it costs.
    max_drop: float = _f("prune.max_drop=0.5", ge=0, le=100)
    num_images: int = _f("prune.num_images=1000", ge=1)
    save_steps: bool = _f()
    finetune_epochs: int = _f("prune.finetune_epochs=2", ge=0)
    finetune_lr: float = _f("prune.finetune_lr=1e-3", gt=0)
    finetune_warmup_epochs: float = _f("prune.finetune_warmup_epochs=0.5", ge=0)
    seed: int = _seed("prune.seed")


class CircuitsSettings(Section):
    """``eval.py analysis=circuits``: direct logit attribution, the logit lens, and
    activation patching between pairs of classes."""

    num_pairs: int = _f("circuits.num_pairs=3", ge=1)
    pairs: ClassPairs = _f("circuits.pairs=[[4,9],[7,2]]")
    pair_images: int = _f("circuits.pair_images=50", ge=1)


class EvalSettings(Section):
    """``python eval.py`` (configs/eval.yaml)."""

    task_name: str = _f()
    seed: int = _seed()
    ckpt_path: str = _f("ckpt_path=latest")
    analysis: Literal[None, "heads", "faithfulness", "prune", "roles", "circuits"] = _f()
    split: Literal["test", "val"] = _f()
    test_time_shift: int | None = _shift("test_time_shift")
    faithfulness: FaithfulnessSettings = None
    precision: Precision = _f()
    prune: PruneSettings = None
    circuits: CircuitsSettings = None
    data: DataSettings | None = None
    trainer: TrainerSettings = None
    logger: dict[str, Any] | None = None
    paths: dict[str, Any] = None


class PredictSettings(Section):
    """``python scripts/predict.py`` (configs/predict.yaml)."""

    task_name: str = _f()
    ckpt_path: str = _f("ckpt_path=latest")
    images: Images = _f()
    pictures: Pictures = _f("pictures=64")
    resume: bool = _f()
    paths: dict[str, Any] = None


class ExportSettings(Section):
    """``python scripts/export.py`` (configs/export.yaml)."""

    task_name: str = _f()
    ckpt_path: str = _f("ckpt_path=latest")
    format: Literal[tuple(EXPORT_FORMATS)] = _f()
    output: str | None = _f()
    overwrite: bool = _f()
    opset: int = _f("opset=18", ge=7)
    check_images: int = _f("check_images=1000", ge=1)
    data: DataSettings | None = None
    paths: dict[str, Any] = None


class ExploreSettings(Section):
    """``python scripts/explore.py`` (configs/explore.yaml)."""

    task_name: str = _f()
    ckpt_path: str = _f("ckpt_path=latest")
    heads_csv: str | None = _f("heads_csv=<eval run>/head_importance.csv")
    server_name: str = _f("server_name=127.0.0.1")
    server_port: int | None = _f("server_port=7860", ge=1, le=65535)
    max_upload_mb: float = _f("max_upload_mb=10", gt=0)
    max_upload_megapixels: float = _f("max_upload_megapixels=25", gt=0)
    data: DataSettings | None = None
    paths: dict[str, Any] = None


class StudySettings(Section):
    """``hydra.sweeper`` of an Optuna study (configs/hydra/sweeper/study.yaml), checked by
    the sweeper (hydra_plugins/vit_mnist_study) before its first trial; the sampler and
    the pruner are built there, each key an argument of its ``_target_``."""

    target: str = Field(None, alias="_target_")
    recursive: bool = Field(None, alias="_recursive_")
    n_trials: int = _f("hydra.sweeper.n_trials=20", ge=1)
    n_jobs: int = _f("hydra.sweeper.n_jobs=1", ge=1)
    study_name: str | None = _f("hydra.sweeper.study_name=mnist_optuna")
    sampler: dict[str, Any] = None
    pruner: dict[str, Any] | None = None
    # {key: Hydra's sweep syntax}: its bounds are checked against TrainSettings.
    params: dict[str, Any] | None = None


# The settings of each command, by the name of its function in vit_mnist.cli.
SETTINGS: dict[str, type[Section]] = {
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
    "speed.cache": (
        "is gone: speed.path=auto stores its choice and reuses it; drop it, or set "
        "speed.remeasure=true to time the paths afresh"
    ),
    "hydra.sweeper.direction": (
        "is gone: an Optuna study's direction is its optimized_metric's (val/loss is "
        "minimised, the accuracies maximised); drop it"
    ),
}

# Hydra instantiation keys, not arguments of the target.
_HYDRA_KEYS = {"_target_", "_partial_", "_args_", "_recursive_", "_convert_"}
# pydantic's error types, in the words of the one line.
_KINDS = {
    "int_type": "a whole number",
    "float_type": "a number",
    "finite_number": "a finite number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list of numbers, such as [0.9,0.999]",
    "model_type": "a section of keys and values",
    "dict_type": "a section of keys and values",
}


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return "null" if value is None else str(value)


def _field(cls: type[Section], name: str) -> Any:
    """The field of ``cls`` that a config key names (``_target_`` is ``target``'s alias)."""
    return next(f for n, f in cls.model_fields.items() if name in (n, f.alias))


def _section_class(annotation: Any) -> type[Section] | None:
    """The :class:`Section` class of a field's annotation (``X`` or ``X | None``)."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, Section):
            return candidate
    return None


def _section(schema: type[Section], section: str) -> type[Section] | None:
    """The settings class of a dotted ``section`` ('' for the top); None if undeclared."""
    cls: type[Section] | None = schema
    for part in filter(None, section.split(".")):
        field = cls.model_fields.get(part) if cls else None
        cls = _section_class(field.annotation) if field else None
    return cls


def _names(cls: type[Section]) -> list[str]:
    return [field.alias or name for name, field in cls.model_fields.items()]


def known_keys(schema: type[Section], section: str) -> list[str]:
    """The keys that ``section`` (dotted, '' for the top) of ``schema`` declares."""
    cls = _section(schema, section)
    return _names(cls) if cls is not None else []


def _is_open(schema: type[Section], name: str) -> bool:
    """Whether the top-level section ``name`` takes keys the schema does not declare: any
    argument of the class its ``_target_`` names (``+trainer.gradient_clip_val=1.0``),
    checked by name, or any key of a free dict (``logger``)."""
    field = schema.model_fields.get(name)
    sub = _section_class(field.annotation) if field else None
    if sub is not None:
        return sub.model_config.get("extra") == "allow"
    kinds = (field.annotation, *typing.get_args(field.annotation)) if field else ()
    return any(k is dict or typing.get_origin(k) is dict for k in kinds)


def unknown_key(
    key: str, schema: type[Section], value: str | None = None, candidates: list[str] | None = None
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
    open_section = bool(section) and value is not None and _is_open(schema, section.split(".")[0])
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


def _range(field: Any, item: bool) -> str:
    """``in [0, 1)``, ``>= 1`` or ``< 1`` from a field's bounds (its items' for a list)."""
    metadata = field.metadata
    if item:  # list[Annotated[T, Field(...)]], or that | None
        items = field.annotation
        if typing.get_origin(items) is not list:  # list[...] | None
            (items,) = (a for a in typing.get_args(items) if a is not type(None))
        if typing.get_origin(items) is Annotated:  # a list with a length: Annotated[list, ...]
            items = typing.get_args(items)[0]
        (inner,) = typing.get_args(items)
        metadata = typing.get_args(inner)[1].metadata
    bound = {k: getattr(m, k) for m in metadata for k in ("ge", "gt", "le", "lt") if hasattr(m, k)}

    def show(limit: float) -> str:
        return f"2**{int(limit).bit_length() - 1}" if limit >= 2**16 else _show(limit)

    low = ("[", bound["ge"]) if "ge" in bound else ("(", bound.get("gt"))
    high = ("]", bound["le"]) if "le" in bound else (")", bound.get("lt"))
    if low[1] is not None and high[1] is not None:
        return f"in {low[0]}{show(low[1])}, {show(high[1])}{high[0]}"
    if low[1] is not None:
        return f"{'>=' if low[0] == '[' else '>'} {show(low[1])}"
    return f"{'<=' if high[0] == ']' else '<'} {show(high[1])}"


def _one_line(
    error: dict[str, Any], cls: type[Section], values: dict, prefix: str, typed: dict[str, str]
) -> str:
    """The project's line for pydantic's ``error`` on ``values`` (checked against ``cls``),
    showing a value as ``typed`` has it (``{key: the override's value as typed}``)."""
    names = [p for p in error["loc"] if isinstance(p, str)]
    item = len(names) < len(error["loc"])  # an item of a list
    node, section = values, cls
    for name in names[:-1]:
        node = node[name]
        section = _section_class(_field(section, name).annotation)
    key = prefix + ".".join(names)
    if error["type"] == "extra_forbidden":
        target = _target_args(node) if len(names) > 1 or prefix else []
        return unknown_key(key, cls, candidates=[*_names(section), *target])
    field = _field(section, names[-1])
    value = typed.get(key, node[names[-1]])  # a str as typed: _show keeps it as it is
    fix = f"; e.g. {field.examples[0]}" if field.examples else ""
    kind = error["type"]
    if kind in _KINDS:
        return f"{key}={_show(value)} must be {_KINDS[kind]}{fix}"
    if kind == "literal_error":
        choices = typing.get_args(field.annotation)
        return f"{key}={_show(value)} is not one of {[_show(c) for c in choices]}"
    if kind in ("too_short", "too_long"):
        length = error["ctx"].get("min_length", error["ctx"].get("max_length"))
        if kind == "too_short" and length == 1:
            return f"{key}={_show(value)} must not be empty{fix}"
        return f"{key}={_show(value)} must have {length} values{fix}"
    if kind.startswith(("greater_than", "less_than")):
        each = ": each value" if item else ""
        return f"{key}={_show(value)}{each} must be {_range(field, item)}{fix}"
    if kind == "value_error":
        return f"{key}={_show(value)} {error['ctx']['error']}{fix}"
    return f"{key}={_show(value)}: {error['msg']}{fix}"


def check_arguments(
    section: type[Section],
    values: dict[str, Any],
    prefix: str = "",
    typed: dict[str, str] | None = None,
) -> None:
    """Check keyword arguments against one section of the schema (e.g. ``ModelSettings``):
    what ``train()`` runs on a model's arguments before any data is loaded.

    ``typed``: the command line's overrides, ``{key: value as typed}``, so that the line
    echoes a value as the user wrote it (``[["4","9"]]``, not ``[[4,9]]``).

    Raises:
        ConfigError: the first key that is undeclared, of the wrong type or out of range,
            named as ``prefix + key``.
    """
    # A Python caller's tuple (a constructor's default) is what a config's list is.
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
    try:
        section.model_validate(values)
    except ValidationError as e:
        raise ConfigError(_one_line(e.errors()[0], section, values, prefix, typed or {})) from None


def check_value(schema: type[Section], key: str, value: Any) -> None:
    """Check one setting, ``key`` (dotted, such as ``"module.lr"``) set to ``value``, against
    ``schema`` as the whole config's check would: its type, range or choices. A key that
    ``schema`` does not declare is left to the caller.

    Raises:
        ConfigError: the line :func:`check_arguments` gives, naming ``key``.
    """
    section, _, name = key.rpartition(".")
    cls = _section(schema, section)
    if cls is not None and name in _names(cls):
        check_arguments(cls, {name: value}, prefix=f"{section}." if section else "")


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
    try:
        return inspect.signature(import_target(target)).parameters
    except (TypeError, ValueError):
        return None


def _target_args(node: Any) -> list[str]:
    """The arguments of ``node``'s ``_target_``, for a "did you mean"; [] without one."""
    try:
        if isinstance(node, dict) and "_target_" in node:
            return list(_target_parameters(node["_target_"]) or [])
    except Exception:  # noqa: BLE001 - only for the hint
        pass
    return []


def check_target(key: str, node: Any) -> None:
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
    if params is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
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
                check_target(f"{key}.{name}[{i}]", item)
        else:
            check_target(f"{key}.{name}", value)


# The schema and the values that last passed it: the command line checks them before the
# task's imports (vit_mnist.cli), and the task's own check (called the same way by tests
# and by Python callers) then does only what needs the imports, the targets.
_passed: tuple[type[Section], dict[str, Any]] | None = None


def check_settings(
    cfg: DictConfig,
    schema: type[Section],
    targets: bool = True,
    typed: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Check every key of ``cfg`` against ``schema`` (one of the ``*Settings`` classes).

    Order: interpolations resolve; every key is declared (or, in an open section such as
    ``trainer``, an argument of its ``_target_``); every value has its declared type and is
    in its range or among its choices; with ``targets``, every section with a ``_target_``
    (``trainer``, ``data``, ``module``, each callback and logger) takes only arguments of
    that class, which imports it (torch, Lightning: seconds; without, no torch is needed).
    Values that passed ``schema`` just before (the command line's check of the same run)
    are not checked against it again. ``typed``: see :func:`check_arguments`.

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
    global _passed
    if _passed != (schema, values):
        check_arguments(schema, values, typed=typed)
        _passed = (schema, values)
    if targets:
        for section, sub in values.items():
            if isinstance(sub, dict) and "_target_" not in sub:  # callbacks, logger: by name
                for name, item in sub.items():
                    check_target(f"{section}.{name}", item)
            else:
                check_target(section, sub)
    return values
