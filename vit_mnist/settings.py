"""The schema of every setting of train, eval, predict and export, checked before any work.

Each entry point's settings are a tree of dataclasses, Hydra's structured configs
(https://hydra.cc/docs/tutorials/structured_config/intro/): OmegaConf checks the type of
every value and rejects keys that are not in the tree; ranges and choices sit beside the
type, in the field's ``metadata``, and are checked here in one place. Sections that a
library builds (``trainer``, ``callbacks``, ``logger``, ``data``) are also checked against
the signature of their ``_target_``, so ``+trainer.gradient_clip_val=1.0`` works and
``+trainer.gradient_clip=1.0`` is refused by name. The defaults stay in ``configs/``: a
field here is ``MISSING`` and says only what a value may be.

Combinations that need more than one value (image size against patch size and the
dataset, classes against the dataset, batch size against the dataset) are checked after
this by the entry point (``vit_mnist.train.check_config``).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from vit_mnist.errors import ConfigError

PRECISIONS = ["32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "64-true"]
ACCELERATORS = ["auto", "cpu", "gpu", "cuda", "mps"]


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


@dataclass
class SpeedSettings:
    path: str = _setting(example="speed.path=auto")
    compile: bool = _setting()
    cache: bool = _setting()


@dataclass
class ModelSettings:
    """``VisionTransformer``'s arguments (vit_mnist/models/vit.py)."""

    img_size: int = _setting(ge=1, example="model.img_size=28")
    in_chans: int = _setting(ge=1, example="model.in_chans=1")
    num_classes: int = _setting(ge=2, example="model.num_classes=10")
    patch_size: int = _setting(ge=1, example="model.patch_size=7")
    embed_dim: int = _setting(ge=1, example="model.embed_dim=64")
    depth: int = _setting(ge=1, example="model.depth=6")
    num_heads: Any = _setting(check=_positive_ints, example="model.num_heads=4")
    head_dim: int | None = _setting(ge=1, example="model.head_dim=16")
    mlp_ratio: float = _setting(gt=0, example="model.mlp_ratio=2.0")
    dropout: float = _setting(ge=0, lt=1, example="model.dropout=0.1")
    attn_dropout: float = _setting(ge=0, lt=1, example="model.attn_dropout=0.1")
    attention_impl: str = _setting(choices=["auto", "explicit", "fused"])
    causal: bool = _setting()
    qkv_bias: bool = _setting()
    drop_path_rate: float = _setting(ge=0, lt=1, example="model.drop_path_rate=0.1")


@dataclass
class ModuleSettings:
    """``ViTClassifier``'s optimiser and loss (vit_mnist/module.py)."""

    _target_: str = _setting()
    lr: float = _setting(gt=0, example="module.lr=2e-3")
    weight_decay: float = _setting(ge=0, example="module.weight_decay=0.05")
    betas: list[float] = _setting(
        ge=0, lt=1, each=True, length=2, example="module.betas=[0.9,0.999]"
    )
    warmup_epochs: float = _setting(ge=0, example="module.warmup_epochs=1")
    min_lr_ratio: float = _setting(ge=0, le=1, example="module.min_lr_ratio=0.01")
    label_smoothing: float = _setting(ge=0, lt=1, example="module.label_smoothing=0.1")
    test_time_shift: int = _setting(ge=0, example="module.test_time_shift=1")


@dataclass
class AugmentSettings:
    degrees: float = _setting(ge=0, le=180, example="data.augment.degrees=10")
    translate: float = _setting(ge=0, le=1, example="data.augment.translate=0.1")
    scale: list[float] = _setting(gt=0, each=True, length=2, example="data.augment.scale=[0.9,1.1]")
    hflip: bool = _setting()
    erasing: float = _setting(ge=0, le=1, example="data.augment.erasing=0.25")
    elastic_alpha: float = _setting(ge=0, example="data.augment.elastic_alpha=34")
    elastic_sigma: float = _setting(gt=0, example="data.augment.elastic_sigma=4")


@dataclass
class DataSettings:
    """The data modules' arguments (vit_mnist/data/); each key is also checked against the
    chosen module's signature, so ``num_train`` is refused for MNIST."""

    _target_: str = _setting()
    data_dir: str | None = _setting()
    batch_size: int = _setting(ge=1, example="data.batch_size=256")
    num_workers: int = _setting(ge=0, example="data.num_workers=2")
    val_size: int = _setting(ge=1, example="data.val_size=5000")
    split_seed: int = _setting(ge=0, example="data.split_seed=12345")
    download: bool = _setting()
    mean: float = _setting(example="data.mean=0.1307")
    std: float = _setting(gt=0, example="data.std=0.3081")
    pin_memory: bool = _setting()
    fast: bool = _setting()
    on_device: bool = _setting()
    augment: AugmentSettings | None = None
    num_train: int = _setting(ge=1, example="data.num_train=512")
    num_val: int = _setting(ge=1, example="data.num_val=128")
    num_test: int = _setting(ge=1, example="data.num_test=128")
    noise: float = _setting(ge=0, example="data.noise=1.0")
    seed: int = _setting(ge=0, example="data.seed=0")


@dataclass
class TrainerSettings:
    """The ``lightning.pytorch.Trainer`` arguments our configs set; any other argument of
    the Trainer may be added (``+trainer.gradient_clip_val=1.0``) and is checked by name."""

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


def _seed() -> Any:
    return _setting(ge=0, lt=2**32, example="seed=1")


@dataclass
class TrainSettings:
    """``python train.py`` (configs/train.yaml)."""

    task_name: str = _setting()
    seed: int = _seed()
    test: bool = _setting()
    ckpt_path: str | None = _setting()
    init_from: str | None = _setting()
    speed: SpeedSettings = field(default_factory=SpeedSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    module: ModuleSettings = field(default_factory=ModuleSettings)
    data: DataSettings = field(default_factory=DataSettings)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    callbacks: dict[str, Any] | None = None
    logger: dict[str, Any] | None = None
    paths: dict[str, Any] = field(default_factory=dict)


@dataclass
class FaithfulnessSettings:
    num_images: int = _setting(ge=1, example="faithfulness.num_images=1000")
    seed: int = _seed()


@dataclass
class PruneSettings:
    step_fraction: float = _setting(gt=0, le=1, example="prune.step_fraction=0.1")
    max_fraction: float = _setting(gt=0, lt=1, example="prune.max_fraction=0.75")
    normalise: bool = _setting()


@dataclass
class EvalSettings:
    """``python eval.py`` (configs/eval.yaml)."""

    task_name: str = _setting()
    seed: int = _seed()
    ckpt_path: str = _setting(example="ckpt_path=latest")
    analysis: str | None = _setting(choices=[None, "heads", "faithfulness", "prune"])
    split: str = _setting(choices=["test", "val"])
    test_time_shift: int | None = _setting(ge=0, example="test_time_shift=1")
    faithfulness: FaithfulnessSettings = field(default_factory=FaithfulnessSettings)
    precision: Any = _setting(check=_precision)
    prune: PruneSettings = field(default_factory=PruneSettings)
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
    paths: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExportSettings:
    """``python scripts/export.py`` (configs/export.yaml)."""

    task_name: str = _setting()
    ckpt_path: str = _setting(example="ckpt_path=latest")
    format: str = _setting(choices=["onnx", "torchscript"])
    output: str | None = _setting()
    opset: int = _setting(ge=7, example="opset=18")
    check_images: int = _setting(ge=1, example="check_images=1000")
    data: DataSettings | None = None
    paths: dict[str, Any] = field(default_factory=dict)


# The settings of each command, by the name of its function in vit_mnist.cli.
SETTINGS: dict[str, type] = {
    "train": TrainSettings,
    "evaluate": EvalSettings,
    "predict": PredictSettings,
    "export": ExportSettings,
}

# Keys of earlier versions, and what replaced them.
RETIRED: dict[str, str] = {
    "model.compile": (
        "is no longer a model setting: torch.compile is one of the speed paths; use "
        "speed.path=compile (or speed.compile=true, with which speed.path=auto times it too)"
    ),
}

# Sections that take keys beyond the dataclass, each then checked against its _target_.
_OPEN = ("trainer",)
# Hydra instantiation keys, not arguments of the target.
_HYDRA_KEYS = {"_target_", "_partial_", "_args_", "_recursive_", "_convert_"}


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return "null" if value is None else str(value)


def _lookup(tree: Any, key: str) -> Any:
    node = tree
    for part in key.replace("[", ".").replace("]", "").split("."):
        if not part:
            continue
        if isinstance(node, list):
            node = node[int(part)]
        elif isinstance(node, dict):
            node = node.get(part)
        else:
            return None
    return node


def _schema_field(schema: type, key: str) -> tuple[Any, Any] | None:
    """(dataclass field, its class) of a dotted ``key`` in ``schema``; None if undeclared."""
    cls, found = schema, None
    for part in key.split("[")[0].split("."):
        if cls is None or not is_dataclass(cls):
            return None
        found = next((f for f in fields(cls) if f.name == part), None)
        if found is None:
            return None
        cls = _dataclass_of(found.type)
    return found, cls


def _dataclass_of(annotation: Any) -> type | None:
    if isinstance(annotation, str):
        annotation = eval(annotation, globals())  # noqa: S307 - our own annotations
    args = getattr(annotation, "__args__", ()) or ()
    for candidate in (annotation, *args):
        if is_dataclass(candidate):
            return candidate
    return None


def _kind(annotation: Any) -> str:
    text = str(annotation)
    for name, words in (
        ("list[float]", "a list of numbers, such as [0.9,0.999]"),
        ("bool", "true or false"),
        ("int", "a whole number"),
        ("float", "a number"),
        ("str", "a string"),
    ):
        if name in text:
            return words
    return "a different type"


def _fix(meta: dict[str, Any]) -> str:
    return f"; e.g. {meta['example']}" if meta.get("example") else ""


def known_keys(schema: type, section: str) -> list[str]:
    """The keys that ``section`` (dotted, '' for the top) of ``schema`` declares."""
    cls = schema if not section else (_schema_field(schema, section) or (None, None))[1]
    return [f.name for f in fields(cls)] if cls is not None and is_dataclass(cls) else []


def _unknown_key(key: str, schema: type, extra: Sequence[str] = ()) -> ConfigError:
    if key in RETIRED:
        return ConfigError(f"{key} {RETIRED[key]}")
    section, _, name = key.rpartition(".")
    candidates = [*known_keys(schema, section), *extra]
    close = difflib.get_close_matches(name, candidates, n=1)
    where = f"a setting of {section}" if section else "a top-level setting"
    hint = f"; did you mean {section + '.' if section else ''}{close[0]}?" if close else ""
    listed = ", ".join(sorted(c for c in candidates if not c.startswith("_")))
    return ConfigError(f"{key} is not {where}{hint} (the settings there: {listed})")


def _check_range(key: str, value: Any, meta: dict[str, Any]) -> None:
    if value is None or value == MISSING:
        return
    if meta.get("check") is not None:
        problem = meta["check"](value)
        if problem:
            raise ConfigError(f"{key}={_show(value)} {problem}{_fix(meta)}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        shown = [_show(c) for c in choices]
        raise ConfigError(f"{key}={_show(value)} is not one of {shown}")
    items = value if meta.get("each") else [value]
    if meta.get("length") is not None and len(value) != meta["length"]:
        raise ConfigError(f"{key}={_show(value)} must have {meta['length']} values{_fix(meta)}")
    tests = {"ge": float.__ge__, "gt": float.__gt__, "le": float.__le__, "lt": float.__lt__}
    for v in items:
        if all(meta.get(b) is None or tests[b](float(v), float(meta[b])) for b in tests):
            continue
        what = ": each value" if meta.get("each") else ""
        raise ConfigError(f"{key}={_show(value)}{what} must be {_range(meta)}{_fix(meta)}")


def _range(meta: dict[str, Any]) -> str:
    """``in [0, 1)``, ``>= 1`` or ``< 1`` from the field's bounds."""

    def show(limit: float) -> str:
        return "2**32" if limit == 2**32 else _show(limit)

    low = ("[", meta["ge"]) if meta.get("ge") is not None else ("(", meta.get("gt"))
    high = ("]", meta["le"]) if meta.get("le") is not None else (")", meta.get("lt"))
    if low[1] is not None and high[1] is not None:
        return f"in {low[0]}{show(low[1])}, {show(high[1])}{high[0]}"
    if low[1] is not None:
        return f"{'>=' if low[0] == '[' else '>'} {show(low[1])}"
    return f"{'<=' if high[0] == ']' else '<'} {show(high[1])}"


def _walk_ranges(cls: type, values: Any, prefix: str) -> None:
    if not isinstance(values, dict):
        return
    for f in fields(cls):
        if f.name not in values:
            continue
        key = f"{prefix}{f.name}"
        sub = _dataclass_of(f.type)
        if sub is not None:
            _walk_ranges(sub, values[f.name], key + ".")
        else:
            _check_range(key, values[f.name], dict(f.metadata))


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
            close = difflib.get_close_matches(name, list(params), n=1)
            hint = f"; did you mean {key}.{close[0]}?" if close else ""
            names = [p for p in params if p != "self"]
            listed = f"its arguments: {', '.join(names)}" if len(names) <= 15 else "see its docs"
            raise ConfigError(
                f"{key}.{name} is not an argument of {node['_target_']}{hint} ({listed})"
            )
        if isinstance(value, list):
            for i, item in enumerate(value):
                _check_target(f"{key}.{name}[{i}]", item)
        else:
            _check_target(f"{key}.{name}", value)


def check_settings(cfg: DictConfig, schema: type) -> dict[str, Any]:
    """Check every key of ``cfg`` against ``schema`` (one of the ``*Settings`` classes).

    Order: interpolations resolve; every key is declared (or, in ``trainer``,
    ``callbacks``, ``logger`` and ``data``, an argument of its ``_target_``); every value
    has its declared type; every value is in its range or among its choices.

    Returns:
        The resolved settings as plain Python values.

    Raises:
        ConfigError: one line naming the key, the value and a valid example.
    """
    try:
        values = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "") or "a setting"
        message = str(e).splitlines()[0]
        if "Missing mandatory value" in message:
            raise ConfigError(
                f"{key} is required; set it on the command line, e.g. {key}=..."
            ) from None
        raise ConfigError(f"{key}: {message}") from None
    values.pop("hydra", None)
    node = OmegaConf.structured(schema)
    for name in _OPEN:
        if name in node:
            OmegaConf.set_struct(node[name], False)
    try:
        OmegaConf.merge(node, values)
    except ConfigKeyError as e:
        extra = _target_args(values, e.full_key)
        raise _unknown_key(e.full_key, schema, extra) from None
    except ValidationError as e:
        key = e.full_key
        found = _schema_field(schema, key)
        annotation = found[0].type if found else None
        meta = dict(found[0].metadata) if found else {}
        raise ConfigError(
            f"{key}={_show(_lookup(values, key))} must be {_kind(annotation)}{_fix(meta)}"
        ) from None
    _walk_ranges(schema, values, "")
    for section in ("trainer", "data", "module", "callbacks", "logger"):
        sub = values.get(section)
        if isinstance(sub, dict) and "_target_" in sub:
            _check_target(section, sub)
        elif isinstance(sub, dict):
            for name, item in sub.items():
                _check_target(f"{section}.{name}", item)
    return values


def _target_args(values: dict[str, Any], key: str) -> list[str]:
    section = key.rpartition(".")[0]
    node = _lookup(values, section)
    if not isinstance(node, dict) or "_target_" not in node:
        return []
    try:
        return list(_target_parameters(node["_target_"]) or [])
    except Exception:  # noqa: BLE001 - only for the hint
        return []


__all__ = [
    "EvalSettings",
    "ExportSettings",
    "PredictSettings",
    "RETIRED",
    "SETTINGS",
    "TrainSettings",
    "check_settings",
    "import_target",
    "known_keys",
]
