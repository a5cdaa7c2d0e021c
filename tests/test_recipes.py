"""Fashion-MNIST, the recipe parts (mirror, random erasing, stochastic depth), the
experiment configs and scripts/results.py."""

from __future__ import annotations

import gzip
import hashlib
import json

import numpy as np
import pytest
import torch
import yaml
from hydra.utils import instantiate

from scripts.results_tables import find_runs, group_rows, heads_plot, markdown_table
from tests.conftest import DATA_DIR, compose_config, compose_with_hydra
from vit_mnist.data import FashionMNISTDataModule, sources
from vit_mnist.data.augment import BatchRandomAffine, BatchRandomErasing
from vit_mnist.errors import ConfigError, DataError
from vit_mnist.models import VisionTransformer, check_model_args

# ---------------------------------------------------------------- Fashion-MNIST sources


def fake_debian_dir(tmp_path, corrupt: str | None = None):
    """Four small gzipped IDX files and the MD5 sums of their uncompressed contents."""
    src = tmp_path / "debian"
    src.mkdir()
    md5 = {}
    for i, name in enumerate(sources.FASHION_MNIST_MD5):
        data = sources._idx_bytes(np.full((3, 28, 28) if "images" in name else (3,), i, np.uint8))
        md5[name] = hashlib.md5(data).hexdigest()
        (src / f"{name}.gz").write_bytes(gzip.compress(b"x" + data if name == corrupt else data))
    return src, md5


def _no_route(*args):
    raise TimeoutError  # an exception whose message is empty


# Offline: the download fails with a message, or with none.
@pytest.mark.parametrize("download", [lambda *a: 1 / 0, _no_route], ids=["message", "empty"])
def test_fashion_files_come_from_the_debian_package(tmp_path, monkeypatch, download):
    src, md5 = fake_debian_dir(tmp_path)
    monkeypatch.setattr(sources, "FASHION_MNIST_MD5", md5)
    monkeypatch.setattr(sources, "DEBIAN_FASHION_MNIST_DIR", src)
    monkeypatch.setattr(sources, "_torchvision_download", download)
    root = tmp_path / "data"
    source = sources._ensure(
        root,
        True,
        folder="FashionMNIST",
        md5=md5,
        offline=lambda r: sources.copy_from_debian(r, src),
        offline_name="test",
        offline_source="Debian dataset-fashion-mnist (MD5-verified)",
    )
    assert source == "Debian dataset-fashion-mnist (MD5-verified)"
    raw = sources.raw_folder(root, "FashionMNIST")
    assert sorted(p.name for p in raw.iterdir() if p.name in md5) == sorted(md5)
    assert sources.read_source(root, "FashionMNIST") == source


def test_fashion_copy_refuses_files_that_are_not_the_official_ones(tmp_path, monkeypatch):
    src, md5 = fake_debian_dir(tmp_path, corrupt="t10k-labels-idx1-ubyte")
    monkeypatch.setattr(sources, "FASHION_MNIST_MD5", md5)
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz decompresses to MD5"):
        sources.copy_from_debian(tmp_path / "data", src)
    assert not (tmp_path / "data").exists()  # nothing written


def test_missing_debian_package_says_how_to_install_it(tmp_path):
    with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist"):
        sources.copy_from_debian(tmp_path / "data", tmp_path / "nowhere")


@pytest.fixture(scope="module")
def fashion_dir():
    try:
        sources.ensure_fashion_mnist(DATA_DIR)
    except DataError as e:
        pytest.skip(f"Fashion-MNIST unavailable here: {e}")
    return DATA_DIR


@pytest.mark.real_data
def test_fashion_mnist_datamodule(fashion_dir):
    dm = FashionMNISTDataModule(data_dir=str(fashion_dir))
    dm.prepare_data()
    dm.setup()
    assert (len(dm.data_train), len(dm.data_val), len(dm.data_test)) == (55_000, 5_000, 10_000)
    x, y = dm.data_test.tensors
    assert x.shape == (10_000, 1, 28, 28) and torch.bincount(y).tolist() == [1000] * 10
    # Normalised with the Fashion-MNIST statistics: about zero mean and unit std.
    assert abs(dm.data_train.normalise(dm.data_train.tensors[0]).mean().item()) < 0.02
    assert dm.class_names[0] == "T-shirt/top" and dm.class_names[9] == "Ankle boot"
    assert "MD5" in dm.source or dm.source == "torchvision download"


@pytest.mark.real_data
@pytest.mark.slow
def test_fashion_class_names_reach_the_tables_and_plots(fashion_dir, tmp_path):
    from vit_mnist.tasks.evaluate import evaluate
    from vit_mnist.tasks.train import train

    overrides = ["data=fashion_mnist", "trainer=cpu", "trainer.max_epochs=1"]
    overrides += ["trainer.limit_train_batches=3", "trainer.limit_val_batches=2"]
    overrides += ["trainer.limit_test_batches=2"]
    overrides += ["model.depth=1", "model.embed_dim=32", "model.num_heads=2"]
    overrides += ["speed.path=reference", "trainer.precision=32-true"]  # auto: test_speed
    metrics = train(compose_config("train", overrides, tmp_path / "train"))
    assert metrics["dataset"] == "fashion_mnist"
    # Two test batches (512 images) hold every class.
    eval_overrides = [f"ckpt_path={metrics['best_ckpt']}", "trainer.limit_test_batches=2"]
    cfg = compose_config("eval", eval_overrides, tmp_path / "eval")
    evaluate(cfg)
    per_class = (tmp_path / "eval" / "per_class.csv").read_text()
    assert "Ankle boot" in per_class and "T-shirt/top" in per_class


# ---------------------------------------------------------------- recipe parts


def test_hflip_mirrors_about_half_the_images():
    torch.manual_seed(0)
    x = torch.randn(400, 1, 28, 28)
    out = BatchRandomAffine(hflip=True)(x)
    # affine_grid's identity map is exact only to float32 rounding: up to 1.5e-5 off here
    # (torch 2.15), against differences of order 1 between an image and its mirror.
    same = torch.isclose(out, x, atol=1e-4).flatten(1).all(1)
    mirrored = torch.isclose(out, x.flip(-1), atol=1e-4).flatten(1).all(1)
    assert bool((same ^ mirrored).all())  # each image is one or the other
    assert 150 < int(mirrored.sum()) < 250


def test_random_erasing_one_rectangle_per_image():
    x = torch.randn(300, 1, 28, 28) + 10  # never equal to the fill
    out = BatchRandomErasing(1.0, area=(0.02, 0.2), fill=-1.0)(x)
    erased = out == -1.0
    assert torch.equal(out[~erased], x[~erased])
    counts = erased.flatten(1).sum(1).float()
    assert bool((counts >= 1).all()) and counts.max() <= 0.2 * 784 * 1.3  # rounding slack
    # Rectangles differ from image to image.
    assert len({tuple(e.nonzero()[0].tolist()) for e in erased[:20]}) > 10
    assert torch.equal(BatchRandomErasing(0.0)(x), x)


def test_stochastic_depth_rates_and_modes():
    model = VisionTransformer(depth=4, drop_path_rate=0.3, patch_size=7, embed_dim=32)
    rates = [block.drop_path.p for block in model.blocks]
    assert rates == pytest.approx([0.0, 0.1, 0.2, 0.3])
    x = torch.randn(16, 1, 28, 28)
    model.train()
    assert not torch.equal(model(x), model(x))  # branches dropped at random
    model.eval()
    assert torch.equal(model(x), model(x))
    with pytest.raises(ConfigError, match="model.drop_path_rate=1.0"):  # the schema's range
        check_model_args({"drop_path_rate": 1.0})


# ---------------------------------------------------------------- experiments


@pytest.mark.parametrize(
    "name",
    ["mnist_best", "fashion_best", "mnist_cpu_best", "mnist_cpu_distilled", "fashion_cpu_best"],
)
def test_best_recipes_stay_under_two_million_parameters(tmp_path, name):
    cfg = compose_config("train", [f"experiment={name}"], tmp_path)
    model = VisionTransformer(**{k: v for k, v in cfg.model.items() if k != "compile"})
    assert sum(p.numel() for p in model.parameters()) <= 2_000_000
    dm = instantiate(cfg.data)
    expected = FashionMNISTDataModule if name.startswith("fashion") else type(dm)
    assert isinstance(dm, expected) and dm.augment is not None
    # The checkpoint that is tested is chosen on the validation split.
    assert cfg.callbacks.model_checkpoint.monitor == "val/acc"
    if name.startswith("mnist_cpu"):  # ... from every epoch, not only the last (the speedrun's)
        assert cfg.trainer.check_val_every_n_epoch == 1 < cfg.trainer.max_epochs


def test_the_distilled_recipe_is_the_speedrun_model_with_a_distillation_token(tmp_path):
    speedrun = compose_config("train", ["experiment=speedrun"], tmp_path)
    distilled = compose_config("train", ["experiment=mnist_cpu_distilled"], tmp_path)
    assert distilled.model.distillation and not speedrun.model.distillation
    assert distilled.task_name == "mnist_cpu_distilled"
    distilled.model.distillation = False
    assert distilled.model == speedrun.model


@pytest.mark.parametrize(
    "gpu, cpu", [("mnist_best", "mnist_cpu_best"), ("fashion_best", "fashion_cpu_best")]
)
def test_a_gpu_recipe_is_its_cpu_recipe_scaled_up(tmp_path, gpu, cpu):
    """A bigger model whose recipe trails a smaller one's is a recipe defect: each GPU recipe
    is a CPU recipe with the hybrid stem, at least as wide, deep and long, on the same data
    and augmentation."""
    big = compose_config("train", [f"experiment={gpu}"], tmp_path)
    small = compose_config("train", [f"experiment={cpu}"], tmp_path)
    assert big.model.stem == "conv" and big.trainer.accelerator == "auto"
    for key in ("embed_dim", "depth"):
        assert big.model[key] >= small.model[key], key
    assert big.trainer.max_epochs >= small.trainer.max_epochs
    assert big.data == small.data
    keep = ("weight_decay", "warmup_epochs", "min_lr_ratio", "label_smoothing", "test_time_shift")
    assert all(big.module[k] == small.module[k] for k in keep)


@pytest.mark.parametrize("name", ["mnist_cpu_best", "mnist_best"])
def test_the_callbacks_a_user_asks_for_are_the_ones_a_recipe_runs(tmp_path, name):
    """A recipe sets its callbacks in its defaults list, so a user's `callbacks=[...]` still
    decides: `mnist_cpu_best` averages the weights, `mnist_best` (as it ran on the GPU) does
    not, and either follows the command line."""
    recipe = compose_config("train", [f"experiment={name}"], tmp_path)
    assert (recipe.callbacks.get("ema") is not None) == (name == "mnist_cpu_best")
    for chosen, has_ema in (("[default,ema]", True), ("[default]", False)):
        cfg = compose_config("train", [f"experiment={name}", f"callbacks={chosen}"], tmp_path)
        assert (cfg.callbacks.get("ema") is not None) == has_ema, chosen


def test_heads_sweep_is_a_multirun_over_heads_and_seeds():
    from hydra.types import RunMode

    cfg = compose_with_hydra("train", ["experiment=heads_sweep"])
    assert cfg.hydra.mode == RunMode.MULTIRUN and cfg.model.embed_dim == 64
    params = cfg.hydra.sweeper.params
    assert params["model.num_heads"] == "1,2,4,8,16" and params.seed == "1,2,3"
    assert all(cfg.model.embed_dim % h == 0 for h in (1, 2, 4, 8, 16))


@pytest.mark.parametrize(
    "study, task", [("mnist_optuna", "train"), ("fashion_optuna", "fashion_cpu_best")]
)
def test_every_study_searches_keys_of_the_recipe_it_tunes_on_validation_only(study, task):
    """Every key a study searches is a key of the recipe it tunes (a misspelt one would
    surface only when the first trial starts), ranked on a validation metric, test off."""
    from omegaconf import OmegaConf

    cfg = compose_with_hydra("train", [f"hparams_search={study}"])
    assert cfg.optimized_metric.startswith("val/") and cfg.test is False
    assert cfg.task_name == task and cfg.hydra.sweeper.study_name == study
    params = cfg.hydra.sweeper.params
    assert len(params) >= 5
    for key in params:
        assert OmegaConf.select(cfg, key) is not None, key


def test_the_fashion_study_trial_is_the_first_quarter_of_the_recipes_full_run():
    # The proxy docs/results.md found to rank as the full runs do: the full run's schedule.
    study = compose_with_hydra("train", ["hparams_search=fashion_optuna"])
    recipe = compose_with_hydra("train", ["experiment=fashion_cpu_best"])
    assert study.module.schedule_epochs == recipe.trainer.max_epochs
    assert study.trainer.max_epochs == round(recipe.trainer.max_epochs / 4)


# ---------------------------------------------------------------- results


def fake_run(path, *, heads, seed, acc, val=0.9, dataset="mnist", extra=(), more=None):
    (path / ".hydra").mkdir(parents=True)
    overrides = ["experiment=heads_sweep", f"model.num_heads={heads}", *extra, f"seed={seed}"]
    (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    metrics = {
        "test/acc": acc,
        "val/acc_best": val,
        "seed": seed,
        "dataset": dataset,
        "experiment": "heads_sweep",
        "num_params": 205962,
        "epochs": 20,
        "device": "cpu (test)",
        "precision": "32-true",
        "train_time_s": 100.0 + seed,
        "model": {"num_heads": heads, "embed_dim": 64},
        "train/acc": acc + 0.01,
        "val/acc": val,
        **(more or {}),
    }
    (path / "metrics.json").write_text(json.dumps(metrics))


def test_results_table_gives_a_distilled_rows_teacher(tmp_path):
    teacher = tmp_path / "teacher"
    (teacher / "checkpoints").mkdir(parents=True)
    (teacher / "metrics.json").write_text(json.dumps({"test/acc": 0.9967, "fit_time_s": 401.2}))
    ckpt = teacher / "checkpoints" / "best.ckpt"
    fake_run(tmp_path / "student", heads=4, seed=1, acc=0.99, extra=[f"module.teacher_ckpt={ckpt}"])
    fake_run(tmp_path / "plain", heads=4, seed=1, acc=0.99)
    table = markdown_table(group_rows(find_runs([tmp_path / "student", tmp_path / "plain"])))
    student, plain = table.splitlines()[2:]
    assert "| 99.67%, 401 s |" in student and "| - |" in plain


def test_results_table_groups_seeds_and_reports_mean_and_std(tmp_path):
    accs = {1: [0.97, 0.98, 0.99], 4: [0.99, 0.99, 0.99]}
    job = 0
    for heads, values in accs.items():
        for seed, acc in enumerate(values, start=1):
            fake_run(tmp_path / "sweep" / str(job), heads=heads, seed=seed, acc=acc)
            job += 1
    (tmp_path / "sweep" / "eval" / "x").mkdir(parents=True)  # not a training run: ignored
    # The same settings typed in another order are the same configuration: one row.
    fake_run(tmp_path / "again", heads=4, seed=4, acc=0.99)
    again = (tmp_path / "again" / ".hydra" / "overrides.yaml").read_text().splitlines()
    (tmp_path / "again" / ".hydra" / "overrides.yaml").write_text("\n".join(again[::-1]))
    assert len(group_rows(find_runs([tmp_path / "sweep", tmp_path / "again"]))) == 2
    rows = group_rows(find_runs([tmp_path / "sweep"]))
    assert [row.first["model"]["num_heads"] for row in rows] == [1, 4]
    mean, std = rows[0].test_acc
    assert mean == pytest.approx(98.0) and std == pytest.approx(1.0)  # sample std
    table = markdown_table(rows)
    assert "98.00 +- 1.00 (n=3)" in table and "99.00 +- 0.00 (n=3)" in table
    assert "`python train.py -m experiment=heads_sweep model.num_heads=1 seed=1,2,3`" in table
    assert table.count("\n") == 2 + 2
    png = heads_plot(rows, tmp_path / "heads.png", "test")
    assert png.read_bytes().startswith(b"\x89PNG")


def test_results_table_names_test_time_augmentation_and_its_one_view_accuracy(tmp_path):
    for seed, (acc, one_view) in enumerate([(0.995, 0.994), (0.996, 0.993)], start=1):
        more = {"test/acc_one_view": one_view}
        fake_run(tmp_path / "runs" / str(seed), heads=4, seed=seed, acc=acc, more=more)
    table = markdown_table(group_rows(find_runs([tmp_path / "runs"])))
    assert "99.55 +- 0.07 (n=2), shifted copies averaged (one view: 99.35) |" in table


def test_results_table_gives_the_whole_command_beside_the_fitting_time(tmp_path):
    # scripts/speedrun.py adds command_wall_s; runs started otherwise show "-".
    for seed, wall in [(1, 130.0), (2, 150.0)]:
        more = {"fit_time_s": 100.0 + seed, "command_wall_s": wall}
        fake_run(tmp_path / "timed" / str(seed), heads=4, seed=seed, acc=0.99, more=more)
    fake_run(tmp_path / "plain" / "1", heads=8, seed=1, acc=0.99)
    timed, plain = group_rows(find_runs([tmp_path / "timed", tmp_path / "plain"]))
    assert timed.markdown()[5:8] == ["102", "-", "140"]
    assert plain.markdown()[5:8] == ["101", "-", "-"]
    table = markdown_table([timed, plain])
    assert len({line.count(" | ") for line in table.strip().splitlines()}) == 1


def test_results_table_gives_each_recipes_fitting_time_over_the_default_runs(tmp_path):
    # A CPU recipe's budget is at most 8x the default run's fitting time on the same CPU.
    cpu = {"device": "cpu (EPYC, AVX512-BF16, 2 threads)"}
    fake_run(tmp_path / "default", heads=4, seed=42, acc=0.99, more={**cpu, "fit_time_s": 200.0})
    for seed, fit in [(1, 1500.0), (2, 1700.0)]:
        more = {**cpu, "device": "cpu (EPYC, AVX512-BF16, 2 processes x 1 thread)"}
        fake_run(
            tmp_path / "recipe" / str(seed),
            heads=4,
            seed=seed,
            acc=0.99,
            more={**more, "fit_time_s": fit},
        )
    fake_run(tmp_path / "other" / "1", heads=8, seed=1, acc=0.99, more={"fit_time_s": 900.0})
    (default,) = find_runs([tmp_path / "default"])
    recipe, other = group_rows(find_runs([tmp_path / "recipe", tmp_path / "other"]))
    assert recipe.budget(default) == "8.00x (7.50-8.50) of 200 s"
    assert other.budget(default) == "-"  # another CPU: no unit
    assert "8.00x (7.50-8.50) of 200 s" in markdown_table([recipe, other], default)


def test_results_table_counts_a_resumed_runs_fitting_time_only_when_carried(tmp_path):
    # A run stopped and resumed is one run: its ckpt_path does not split the row; its
    # fitting time is the sum its checkpoint carried, or unknown ("-") when it carried none.
    for seed, carried in [(1, 300.0), (2, 290.0)]:
        more = {"fit_time_s": 400.0, "fit_time_resumed_s": carried, "resumed_from": "x.ckpt"}
        fake_run(
            tmp_path / "carried" / str(seed),
            heads=4,
            seed=seed,
            acc=0.99,
            extra=[f"ckpt_path=/runs/{seed}/last.ckpt"],
            more=more,
        )
    for seed in (1, 2):  # written before the time was carried: the last stretch only
        more = {"fit_time_s": 16.0, "resumed_from": "x.ckpt"}
        fake_run(tmp_path / "old" / str(seed), heads=8, seed=seed, acc=0.99, more=more)
    carried, old = group_rows(find_runs([tmp_path / "carried", tmp_path / "old"]))
    assert len(carried.runs) == 2 and "ckpt_path" not in carried.command()
    assert carried.markdown()[5] == "400"
    assert old.fit_times() == [] and old.markdown()[5] == "-"


def test_results_table_gives_each_cpu_class_its_own_row(tmp_path):
    # The speedrun's 5 seeds on an AVX-512 CPU and again under AVX2 emulation: one command.
    for seed in (1, 2):
        for cls in ("AVX512-BF16", "AVX2 on AVX512-BF16"):
            more = {"device": f"cpu (EPYC, {cls}, 2 threads)"}
            fake_run(tmp_path / cls / str(seed), heads=4, seed=seed, acc=0.99, more=more)
    rows = group_rows(find_runs([tmp_path / "AVX512-BF16", tmp_path / "AVX2 on AVX512-BF16"]))
    assert [(row.runs[0].device(), len(row.runs)) for row in rows] == [
        ("cpu (EPYC, AVX512-BF16, 2 threads)", 2),
        ("cpu (EPYC, AVX2 on AVX512-BF16, 2 threads)", 2),
    ]


def test_results_command_quotes_what_a_shell_would_expand(tmp_path):
    for seed in (1, 2):
        extra = ["data.augment.scale=[0.95,1.05]"]
        fake_run(tmp_path / "runs" / str(seed), heads=4, seed=seed, acc=0.99, extra=extra)
    (row,) = group_rows(find_runs([tmp_path / "runs"]))
    # Unquoted, bash would read [0.95,1.05] as a glob pattern.
    assert row.command() == (
        "python train.py -m experiment=heads_sweep model.num_heads=4 "
        "'data.augment.scale=[0.95,1.05]' seed=1,2"
    )


def test_heads_report_summarises_every_head_and_replaces_its_own_section(tmp_path):
    from scripts.results import HEADS_END, HEADS_START, write_heads_report
    from scripts.results_tables import heads_sweep_table

    for job, heads in enumerate([1, 4]):
        run = tmp_path / "sweep" / str(job)
        fake_run(run, heads=heads, seed=1, acc=0.98)
        (run / "heads").mkdir()
        lines = ["layer,head,acc_drop,loss_increase,entropy_nats,mean_distance_px"]
        lines += [f"0,{h},{0.01 * (h + 1)},0.1,{1.0 + h},{5.0 * (h + 1)}" for h in range(heads)]
        (run / "heads" / "head_importance.csv").write_text("\n".join(lines) + "\n")
    rows = group_rows(find_runs([tmp_path / "sweep"]))
    table = heads_sweep_table(rows)
    # 4 heads: distances 5, 10, 15, 20 px -> median 12.50, 10th-90th percentile 6.50-18.50.
    assert "| 4 | 16 | 1 | 98.00 +- 0.00 | 90.00 | +9.00 | 101 |" in table
    assert "12.50 (6.50-18.50)" in table and "2.50 (4.00)" in table
    # The header and every row have as many cells.
    assert len({line.count(" | ") for line in table.strip().splitlines()}) == 1
    report = tmp_path / "docs" / "results.md"
    report.parent.mkdir()
    report.write_text("# Results\n\nkept\n")
    write_heads_report(rows, report)
    write_heads_report(rows, report)  # a second run replaces the section, never appends
    text = report.read_text()
    assert text.count(HEADS_START) == 1 and text.count(HEADS_END) == 1 and "kept" in text
    assert (report.parent / "heads_sweep_heads.png").read_bytes().startswith(b"\x89PNG")


def test_roles_report_gives_each_layers_spread_per_token_count(tmp_path):
    """Two seeds of 2 heads at patch 4 and one of 1 head at patch 7: per token count the
    accuracy table, then per layer the lowest and highest head's figures, meaned over
    seeds (heads are not matched across seeds)."""
    from scripts.results import ROLES_END, ROLES_START, write_roles_report

    columns = "layer,head,ink_share,ink_area,end_share,end_area,curve_share,curve_area,"
    columns += (
        "centre_distance_px,centre_distance_uniform_px,mean_distance_px,acc_drop,entropy_nats"
    )
    for job, (patch, heads, seed) in enumerate([(4, 2, 1), (4, 2, 2), (7, 1, 1)]):
        run = tmp_path / "sweep" / str(job)
        model = {"num_heads": heads, "embed_dim": 64, "patch_size": patch, "depth": 1}
        fake_run(run, heads=heads, seed=seed, acc=0.98, extra=[f"model.patch_size={patch}"])
        metrics = json.loads((run / "metrics.json").read_text())
        (run / "metrics.json").write_text(json.dumps({**metrics, "model": model}))
        (run / "roles").mkdir()
        # Head h of seed s: ink share 0.2 * (h + s) of an area of 0.2, so ink lift h + s.
        lines = [columns] + [
            f"0,{h},{0.2 * (h + seed)},0.2,0.1,0.1,0.0,0.1,5.0,10.0,{4.0 + h},0.01,2.0"
            for h in range(heads)
        ]
        (run / "roles" / "roles.csv").write_text("\n".join(lines) + "\n")
    rows = group_rows(find_runs([tmp_path / "sweep"]))
    report = tmp_path / "results.md"
    write_roles_report(rows, report)
    write_roles_report(rows, report)  # replaced, not appended
    text = report.read_text()
    assert text.count(ROLES_START) == 1 and text.count(ROLES_END) == 1
    assert text.index("Patch 7, 16 patch tokens") < text.index("Patch 4, 49 patch tokens")
    # 49 tokens: ink lifts 1, 2 (seed 1) and 2, 3 (seed 2) -> low 1.5, high 2.5; the
    # stroke ends' lift is 1, over the ink lift 1, 1/2 and 1/2, 1/3 -> 0.42-0.75.
    assert (
        "| 49 | 2 | 0 | 1.50-2.50 | 0.42-0.75 | 0.00-0.00 | 0.50-0.50 | 4.00-5.00 | 1.00-1.00 |"
        in text
    )
    assert "| 16 | 1 | 0 | 1.00 | 1.00 | 0.00 | 0.50 | 4.00 | 1.00 |" in text
    # Each run on a line of its own, with where it ran and its fitting time.
    assert "| 4 | 2 | 2 | cpu (test) | 32-true, - | 102 | 98.00 | `1` |" in text
    # Without analysis=heads, the accuracy table's per-head columns come from roles.csv.
    assert "| 2 | 32 | 2 | 98.00 +- 0.00 |" in text and "4.50 (4.00-5.00)" in text


def test_results_script_without_runs_is_one_line(tmp_path, capsys):
    from scripts.results import main

    assert main([str(tmp_path)]) == 2  # the script's exit status (sys.exit(main()))
    err = capsys.readouterr().err
    assert err.startswith("error: no training run") and len(err.strip().splitlines()) == 1
    # The folder as the user wrote it, not Python's PosixPath('...').
    assert err.strip().endswith(f"under {tmp_path}") and "Path(" not in err


def test_ema_callback_trains_and_validates_with_averaged_weights(make_train_cfg):
    from vit_mnist.tasks.train import train

    cfg = make_train_cfg("callbacks=[default,ema]", "callbacks.ema.update_starting_at_step=2")
    assert cfg.callbacks.ema._target_.endswith("EMAWeightAveraging")
    metrics = train(cfg)
    assert 0 <= metrics["test/acc"] <= 1 and metrics["epochs"] == 2


def test_proxy_table_ranks_the_configurations_by_their_early_and_full_validation(tmp_path, capsys):
    # A study's proxy is trusted only if its ranking agrees with the full runs' (issue 77).
    from torch.utils.tensorboard import SummaryWriter

    from scripts.results_tables import proxy_table

    def run(path, curve):
        fake_run(path, heads=4, seed=1, acc=curve[-1])
        with SummaryWriter(path / "tensorboard") as writer:
            for step, value in enumerate(curve):
                writer.add_scalar("val/acc", value, step)

    curves = {  # c starts fastest but ends last: the quarter proxy gets it wrong
        "a": [0.50, 0.60, 0.70, 0.80, 0.85, 0.90, 0.92, 0.93],
        "b": [0.40, 0.55, 0.75, 0.795, 0.86, 0.89, 0.90, 0.91],
        "c": [0.70, 0.75, 0.78, 0.79, 0.80, 0.81, 0.82, 0.83],
    }
    shorts = {"a": [0.6, 0.7], "b": [0.5, 0.8], "c": [0.75, 0.78]}  # ranks b > c > a

    def untested(path):  # a run with test=false: no test/acc
        metrics = path / "metrics.json"
        trial = {k: v for k, v in json.loads(metrics.read_text()).items() if k != "test/acc"}
        metrics.write_text(json.dumps(trial))

    for name in curves:
        run(tmp_path / "full" / name, curves[name])
        run(tmp_path / "short" / name, shorts[name])
        untested(tmp_path / "short" / name)  # a study's trial never reads the test set

    def rows(table):
        return [line.strip("| ").split(" | ") for line in table.splitlines()]

    full = find_runs([tmp_path / "full"])
    table = rows(proxy_table(full))
    assert table[2] == ["`a`", "60.00", "80.00", "8", "93.00", "93.00"]
    assert table[-1][1:3] == ["-0.50", "+1.00"]
    with pytest.raises(FileNotFoundError, match="no training run"):
        find_runs([tmp_path / "short"])  # a results row needs a test accuracy
    table = rows(proxy_table(full, find_runs([tmp_path / "short"], tested=False)))
    assert table[0][1] == "2-epoch proxy: best val acc %"
    assert table[2][1] == "70.00"
    assert table[-1][1:4] == ["-0.50", "-0.50", "+1.00"]

    # The full runs that check a study's proxy rank on validation only (test=false) too:
    # the script tables them without a results table, and shows no test accuracy.
    from scripts.results import main

    for name in curves:
        untested(tmp_path / "full" / name)
    assert main([str(tmp_path / "full"), "--proxy-runs", str(tmp_path / "short")]) == 0
    table = rows(capsys.readouterr().out.strip())
    assert table[0][1] == "2-epoch proxy: best val acc %"
    assert table[2][-1] == "-" and table[-1][1:4] == ["-0.50", "-0.50", "+1.00"]
    with pytest.raises(FileNotFoundError, match="no training run"):
        find_runs([tmp_path / "full"])  # the results table still needs a test accuracy


def test_results_script_refuses_a_missing_proxy_or_default_run_in_one_line(tmp_path, capsys):
    from scripts.results import main

    fake_run(tmp_path / "runs" / "1", heads=4, seed=1, acc=0.9)
    fake_run(tmp_path / "damaged" / "1", heads=4, seed=1, acc=0.9)
    metrics = tmp_path / "damaged" / "1" / "metrics.json"
    metrics.write_text(metrics.read_text()[:20])  # cut off mid-write
    assert main([str(tmp_path / "damaged")]) == 2
    assert capsys.readouterr().err == (
        f"error: {metrics.parent} cannot be read (JSONDecodeError); move that run dir out of "
        "the way or train it again\n"
    )
    for option in ("--proxy-runs", "--default-run"):
        assert main([str(tmp_path / "runs"), option, str(tmp_path / "nowhere")]) == 2
        assert capsys.readouterr().err == f"error: {tmp_path / 'nowhere'} does not exist\n"
