"""Shared fixtures: the real Hydra configs, composed with tiny overrides."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

import vit_mnist  # noqa: F401  (registers the ${vit_mnist.cwd:} resolver of configs/paths)

ROOT = Path(__file__).resolve().parents[1]

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Beside other workers, one thread each: two workers of two threads on two cores ran
    # the suite 1.4x slower than with one (threads waiting on each other). The variable
    # reaches the train.py processes that tests start.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

CONFIG_DIR = str(ROOT / "configs")
# Real MNIST lives in the repository's data/ folder, shared with `make train`, so the
# offline rebuild happens at most once per clone.
DATA_DIR = ROOT / "data"

# A model small enough for a test to train in seconds on 2 cores.
TINY_MODEL = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.patch_size=7"]
# One epoch of synthetic data, as a `python train.py` test types it: the reference path in
# float32 (the speed layer's own tests time the paths), no progress bar in the output.
ONE_EPOCH = [
    "data=synthetic",
    "trainer=cpu",
    "trainer.max_epochs=1",
    "~callbacks.progress_bar",
    "speed.path=reference",
    "trainer.precision=32-true",
]


def compose_with_hydra(name: str, overrides: list[str]) -> DictConfig:
    """``configs/<name>.yaml`` composed with ``overrides``, its ``hydra`` section included."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name=name, overrides=overrides, return_hydra_config=True)


def compose_config(name: str, overrides: list[str], output_dir: Path) -> DictConfig:
    """Compose ``configs/<name>.yaml`` as ``python <name>.py`` would, run dir at ``output_dir``."""
    cfg = compose_with_hydra(name, overrides)
    # Resolves ${hydra:...} interpolations outside of @hydra.main.
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(output_dir)
        cfg.paths.data_dir = str(DATA_DIR)
        del cfg.hydra
    return cfg


@pytest.fixture
def make_train_cfg(tmp_path):
    """``make_train_cfg(*overrides)`` -> a tiny synthetic training config in ``tmp_path``."""

    def make(*overrides: str, output_dir: Path | None = None) -> DictConfig:
        base = [
            "data=synthetic",
            "trainer=cpu",
            "trainer.max_epochs=2",
            "trainer.log_every_n_steps=2",
            # The speed layer's own tests time the paths (tests/test_speed.py); here the
            # reference path in float32 keeps every run short and alike.
            "speed.path=reference",
            "trainer.precision=32-true",
        ]
        base += TINY_MODEL
        return compose_config("train", [*base, *overrides], output_dir or tmp_path / "train")

    return make


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """Built kernels go to a fresh folder, not the user's cache, shared by the run's xdist
    workers: a build is a compiler process of about 1.5 s per shape class, and each worker
    built every one it met. A library is written whole under its final name
    (vit_mnist/speed/native.py), so a worker never loads another's half-written build."""
    old = os.environ.get("VIT_MNIST_CACHE")
    cache = tmp_path_factory.mktemp("vit_mnist_cache")
    base = tmp_path_factory.getbasetemp()  # under xdist: one per worker, in the run's folder
    kernels = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "kernels"
    kernels.mkdir(exist_ok=True)
    (cache / "kernels").symlink_to(kernels, target_is_directory=True)
    os.environ["VIT_MNIST_CACHE"] = str(cache)
    yield
    if old is None:
        del os.environ["VIT_MNIST_CACHE"]
    else:
        os.environ["VIT_MNIST_CACHE"] = old


@pytest.fixture(autouse=True)
def _private_speed_choices(monkeypatch, tmp_path):
    """Each test starts with no stored speed choice (vit_mnist/speed/stored_choices.py):
    a choice stored by one test would be reused by the next with the same model."""
    from vit_mnist.speed import stored_choices

    file = tmp_path / "speed_choices" / stored_choices.FILE_NAME
    monkeypatch.setattr(stored_choices, "store_path", lambda: file)


@pytest.fixture
def one_round_auto(monkeypatch):
    """``speed.path=auto`` timing each candidate for one round of one step, even before a
    tiny run: enough for a test of what is done with the figures; the rounds have tests of
    their own (tests/test_speed.py)."""
    import functools

    from vit_mnist.speed import choose

    timing = functools.partial(choose.time_candidates, rounds=1, steps=1, min_round_s=0.0)
    monkeypatch.setattr(choose, "time_candidates", timing)
    # A tiny run counts as long enough to time (one_round_auto's users test the timing).
    monkeypatch.setattr(choose, "too_short_to_time", lambda pairs, steps: False)


@pytest.fixture(autouse=True)
def _deterministic_mode_put_back():
    """``trainer.deterministic=true`` turns on torch's deterministic algorithms for the
    whole process, and inductor keys its compile cache on that setting: left on, every
    later compile in the worker misses the cache (18 s against 4 s for test_speed's)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _run_dirs_in_the_checkout() -> set[Path]:
    """What a run leaves in the checkout: run dirs (outputs/<task>/runs/<time>, and
    multiruns), Hydra's and Lightning's default folders."""
    made = {*ROOT.glob("outputs/*/*/*"), *ROOT.glob("multirun/*"), *ROOT.glob("lightning_logs")}
    return made


@pytest.fixture(autouse=True)
def _writes_only_under_temporary_folders():
    """Every test writes only under temporary folders (issue 102: one left
    outputs/train/runs/<time>/.hydra in the checkout): a test that leaves a run dir there
    errors, naming it."""
    before = _run_dirs_in_the_checkout()
    yield
    left = sorted(map(str, _run_dirs_in_the_checkout() - before))
    assert not left, f"the test wrote into the checkout: {left}"


@pytest.fixture(scope="session")
def mnist_dir():
    """The real MNIST files (fetched or rebuilt offline once); skips where impossible."""
    from vit_mnist.data.sources import ensure_mnist
    from vit_mnist.errors import DataError

    try:
        ensure_mnist(DATA_DIR)
    except DataError as e:
        pytest.skip(f"real MNIST unavailable here: {e}")
    return DATA_DIR


def pytest_report_header() -> str:
    """The instruction-set class the run's kernels use: CI runs the ``isa`` tests twice."""
    from vit_mnist.hardware import isa_class

    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    return f"CPU class: {isa_class()}" + (f" (ATEN_CPU_CAPABILITY={forced})" if forced else "")
