"""`scripts/predict.py` on files, folders and glob patterns: predictions.csv, failed files
reported by name, exit status 1 when any failed."""

from __future__ import annotations

import csv
import logging
import os
import random
import re
import signal
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from tests.conftest import TINY_MODEL, compose_config
from vit_mnist.data.images import collect_images, mnist_preprocess
from vit_mnist.tasks.predict import (
    CSV_COLUMNS,
    LIST_AT_MOST,
    main,
    output_stems,
    predict_images,
)
from vit_mnist.training.checkpointing import load_model
from vit_mnist.training.module import RUN_INFO_KEY, ViTClassifier

TOP3 = re.compile(r"^\d:[01]\.\d{3} \d:[01]\.\d{3} \d:[01]\.\d{3}$")


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    """An untrained tiny model saved as a Lightning checkpoint of this project: its model
    arguments, weights and the run info with the data normalisation. Enough for
    ``load_model``, and no training to wait for."""
    torch.manual_seed(0)
    model = {k.removeprefix("model."): int(v) for k, v in (o.split("=") for o in TINY_MODEL)}
    module = ViTClassifier(model=model)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.ckpt"
    torch.save(
        {
            "state_dict": module.state_dict(),
            "hyper_parameters": dict(module.hparams),
            "pytorch-lightning_version": L.__version__,
            RUN_INFO_KEY: {"data": {"mean": 0.1307, "std": 0.3081}},
        },
        path,
    )
    return path


def draw_digit(path: Path, seed: int, size: int = 48) -> Path:
    """A stroke of dark ink on white paper, saved in the format its suffix names."""
    rng = random.Random(seed)
    image = Image.new("RGB", (size, size), "white")
    points = [(rng.randint(6, size - 6), rng.randint(6, size - 6)) for _ in range(4)]
    ImageDraw.Draw(image).line(points, fill="black", width=5)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def predict(
    ckpt: Path, images: str, run_dir: Path, *overrides: str
) -> tuple[int, list[dict[str, str]]]:
    """``main`` as the command line runs it: the exit status and the CSV's rows."""
    cfg = compose_config("predict", [f"ckpt_path={ckpt}", f"images={images}", *overrides], run_dir)
    try:
        main(cfg)
        code = 0
    except SystemExit as e:
        code = e.code
    csv_path = run_dir / "predictions.csv"
    rows = list(csv.DictReader(csv_path.open())) if csv_path.exists() else []
    return code, rows


def check_predicted(row: dict[str, str], run_dir: Path) -> None:
    assert row["error"] == "", row
    assert TOP3.match(row["top3"]), row["top3"]
    assert row["top3"].split()[0].split(":")[0] == row["predicted"]
    assert 0 < float(row["confidence"]) <= 1
    assert (run_dir / row["attention"]).is_file()
    assert (run_dir / row["attention"].replace("_attention", "_28x28")).is_file()


def test_folder_skips_other_files_and_reports_a_broken_image(tiny_ckpt, tmp_path, capsys, caplog):
    folder = tmp_path / "my_digits"
    for i, name in enumerate(["a.png", "b.PNG", "c.jpg", "d.JPEG", "e.bmp", "f.webp"]):
        draw_digit(folder / name, seed=i)
    whole = (folder / "a.png").read_bytes()
    (folder / "broken.png").write_bytes(whole[: len(whole) // 2])  # a cut-off download
    (folder / "notes.txt").write_text("not an image")
    (folder / "README").write_text("not an image")
    (folder / "._a.png").write_bytes(b"\x00\x05\x16\x07 macOS metadata")
    draw_digit(folder / "sub" / "z.png", seed=9)  # not searched: a folder is read flat
    caplog.set_level(logging.INFO, logger="vit_mnist")

    code, rows = predict(tiny_ckpt, str(folder), tmp_path / "run")

    assert code == 1
    names = ["a.png", "b.PNG", "broken.png", "c.jpg", "d.JPEG", "e.bmp", "f.webp"]
    assert [r["path"] for r in rows] == [str(folder / n) for n in names]
    assert list(rows[0]) == list(CSV_COLUMNS)
    broken = rows.pop(2)
    assert broken["error"].startswith("OSError") and "truncated" in broken["error"]
    assert broken["predicted"] == broken["confidence"] == broken["top3"] == ""
    for row in rows:
        check_predicted(row, tmp_path / "run")
    out = capsys.readouterr().out
    assert f"{folder / 'broken.png'}: cannot be read (OSError" in out
    assert f"{folder / 'a.png'}: " in out  # a few images: one line each
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1, skipped
    for part in ("3 files", ".txt", "hidden", "no suffix", "1 subfolder", "**"):
        assert part in skipped[0], skipped[0]


def test_patterns_duplicates_missing_paths_and_shared_stems(
    tiny_ckpt, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    for i, name in enumerate(["a/1.png", "a/2.png", "a/deep/3.png", "b/1.png"]):
        draw_digit(Path(name), seed=i)
    Path("b/note.txt").write_text("skipped")

    images = "[a/*.png,./a/1.png,b/,a/**/3.png,a/2.png,missing.png,nothing*.png]"
    code, rows = predict(tiny_ckpt, images, tmp_path / "run")

    assert code == 1
    # Duplicates (./a/1.png, a/2.png again) are kept once, at their first place; the
    # values that found nothing come last, named as given.
    assert [r["path"] for r in rows] == [
        "a/1.png",
        "a/2.png",
        "b/1.png",
        "a/deep/3.png",
        "missing.png",
        "nothing*.png",
    ]
    for row in rows[:4]:
        check_predicted(row, tmp_path / "run")
    # a/1.png and b/1.png share a stem: each gets its own pictures.
    assert [r["attention"] for r in rows[:4]] == [
        "a_1_attention.png",
        "2_attention.png",
        "b_1_attention.png",
        "3_attention.png",
    ]
    assert rows[4]["error"] == "no such file or folder"
    assert rows[5]["error"] == "no file matches this pattern"
    out = capsys.readouterr().out
    assert "missing.png: cannot be read (no such file or folder)" in out
    assert "nothing*.png: cannot be read" in out

    # Recursive ** and a character class; an existing file whose name looks like a
    # pattern is that file.
    assert collect_images("a/**/*.png")[0] == [Path(p) for p in ["a/1.png", "a/2.png"]] + [
        Path("a/deep/3.png")
    ]
    assert collect_images(["a/[2-9].png"]) == ([Path("a/2.png")], [])
    odd = draw_digit(Path("odd[1].png"), seed=5)
    assert collect_images(str(odd)) == ([odd], [])


def test_images_that_name_nothing_are_one_error_line(tiny_ckpt, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "list.csv").write_text("x")
    images = f"[{tmp_path / 'nope'}/,{tmp_path / 'none*.png'},{tmp_path / 'empty'}]"
    code, rows = predict(tiny_ckpt, images, tmp_path / "run")
    assert code == 2 and rows == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: images names no image: "), err
    for part in ("nope/: no such file", "none*.png: no file matches", "empty: the folder holds"):
        assert part in err[0], err[0]
    assert "images=my_digits/" in err[0]  # how to fix it


def test_batches_match_one_pass_and_stems_stay_distinct(tiny_ckpt, tmp_path):
    paths = [draw_digit(tmp_path / "in" / f"{i}.png", seed=i) for i in range(5)]
    module, _ = load_model(tiny_ckpt)
    one = predict_images(module, paths, tmp_path / "one")
    batched = predict_images(module, paths, tmp_path / "batched", batch_size=2)
    for a, b in zip(one, batched, strict=True):
        assert [n for n, _ in a.top] == [n for n, _ in b.top]
        assert [p for _, p in a.top] == pytest.approx([p for _, p in b.top], abs=1e-5)
        # One row of 84-pixel tiles: input, 2 heads, rollout, relevance.
        with Image.open(b.picture) as picture:
            tiles = np.asarray(picture.convert("RGB"))[-86:-2]
        assert tiles.shape[1] == 2 + 5 * 86
        assert not np.array_equal(tiles[:, 2 + 3 * 86 : 4 * 86], tiles[:, 2 + 4 * 86 : 5 * 86])

    stems = output_stems(
        [Path(p) for p in ["a/7.png", "b/7.png", "a/7.jpg", "a_7.png", "c/X.png", "d/x.png"]]
    )
    assert stems[:2] == ["a_7", "b_7"]
    assert len({s.casefold() for s in stems}) == len(stems), stems


def test_a_folder_of_pngs_gives_one_row_each_and_a_summary(tiny_ckpt, tmp_path, capsys):
    # `python scripts/predict.py ckpt_path=... images=<folder>` without the process start-up
    # (the command line itself is tested in tests/test_cli.py).
    # More than LIST_AT_MOST images: one row each, and a summary instead of a line each.
    count = LIST_AT_MOST + 10
    folder = tmp_path / "digits"
    for i in range(count):
        draw_digit(folder / f"digit_{i:03d}.png", seed=i, size=32)
    run_dir = tmp_path / "run"
    code, rows = predict(tiny_ckpt, str(folder), run_dir)
    assert code == 0
    assert len(rows) == count
    assert [r["path"] for r in rows] == [str(p) for p in sorted(folder.iterdir())]
    assert all(r["error"] == "" and TOP3.match(r["top3"]) for r in rows)
    assert len(list(run_dir.glob("*_attention.png"))) == count
    out = capsys.readouterr().out
    assert f"{count} of {count} images predicted" in out
    assert f"predictions: {run_dir / 'predictions.csv'}" in out
    assert len(out.strip().splitlines()) <= 3, out


def _digit_seven(size: int = 60) -> np.ndarray:
    """Dark ink on white paper: a 7 (top bar and a diagonal), not symmetric under rotation."""
    a = np.full((size, size), 255, np.uint8)
    a[8:14, 10:50] = 0
    for r in range(14, 52):
        c = 50 - (r - 14) // 2
        a[r, c - 3 : c + 3] = 0
    return a


def test_exif_orientation_is_applied(tmp_path):
    # A phone stores the pixels sideways and says so in EXIF (orientation 6: rotate 90
    # degrees clockwise to view); the digit must be read the way it is viewed.
    upright = Image.fromarray(_digit_seven())
    stored = upright.rotate(90, expand=True)  # what the sensor wrote
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "phone.jpg"
    stored.save(path, exif=exif, quality=95)
    with Image.open(path) as image:
        seen = mnist_preprocess(image)
    expected = mnist_preprocess(upright)
    assert (seen - expected).abs().mean() < 0.02
    assert (mnist_preprocess(stored) - expected).abs().mean() > 0.05  # rotation matters


def test_16_bit_grey_is_scaled_not_clipped(tmp_path):
    # Ink at 20 000 and paper at 60 000 of 65 535: convert("L") clipped both to 255, and
    # the digit was called blank.
    sixteen = (20_000 + _digit_seven().astype(np.float64) / 255 * 40_000).round()
    path = tmp_path / "scan16.png"
    Image.fromarray(sixteen.astype(np.uint16)).save(path)
    expected = mnist_preprocess(Image.fromarray((sixteen / 257).round().astype(np.uint8)))
    with Image.open(path) as image:
        assert image.mode.startswith("I")
        torch.testing.assert_close(mnist_preprocess(image), expected, atol=0.01, rtol=0)
        as_int32 = image.convert("I")  # how some decoders hand 16-bit grey over
    torch.testing.assert_close(mnist_preprocess(as_int32), expected, atol=0.01, rtol=0)


def test_an_image_over_the_pixel_limit_is_refused_by_name(tiny_ckpt, tmp_path, monkeypatch):
    # A decompression bomb (a small file of huge dimensions) is one failed file; the image
    # beside it is still predicted. Pillow's limit is lowered so the test needs no bomb,
    # but not below the label texts of the picture (Pillow checks their masks against it).
    good = draw_digit(tmp_path / "good.png", seed=1, size=30)
    bomb = draw_digit(tmp_path / "bomb.png", seed=2, size=300)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 20_000)  # an error above 40 000 pixels
    module, _ = load_model(tiny_ckpt)
    good_result, bomb_result = predict_images(module, [good, bomb], tmp_path / "out")
    assert good_result.error is None and good_result.top
    assert "DecompressionBombError" in bomb_result.error and not bomb_result.top


class _Unhandled(Exception):
    """A signal that reached the test's own handler: the code under test did not take it."""


def _test_handler(signum, frame):
    raise _Unhandled(signal.Signals(signum).name)


def test_an_interrupt_keeps_the_finished_rows_and_resume_does_the_rest(
    tiny_ckpt, tmp_path, monkeypatch, capsys
):
    # A real SIGTERM to this process during the third batch of 2: the two finished
    # batches are in predictions.csv, one line says so, exit status 143.
    folder = tmp_path / "digits"
    paths = [draw_digit(folder / f"{i}.png", seed=i, size=30) for i in range(9)]
    run_dir = tmp_path / "run"
    monkeypatch.setattr("vit_mnist.tasks.predict.BATCH_SIZE", 2)
    from vit_mnist import predict as predict_module

    real_batch = predict_module._predict_batch
    seen: list[str] = []

    def batch(module, batch_paths, *args, **kwargs):
        seen.extend(map(str, batch_paths))
        if len(seen) == 6 and not (run_dir / "stop").exists():
            (run_dir / "stop").touch()
            os.kill(os.getpid(), signal.SIGTERM)
        return real_batch(module, batch_paths, *args, **kwargs)

    monkeypatch.setattr(predict_module, "_predict_batch", batch)
    previous = signal.signal(signal.SIGTERM, _test_handler)
    try:
        code, rows = predict(tiny_ckpt, str(folder), run_dir)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143
    assert [r["path"] for r in rows] == [str(p) for p in paths[:4]]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("Interrupted (SIGTERM): 4 of 9 images are in "), err
    assert f"resume=true hydra.run.dir={run_dir}" in err[0]

    # Without resume=true the run dir is refused: its CSV is not replaced.
    code, rows = predict(tiny_ckpt, str(folder), run_dir)
    assert code == 2 and len(rows) == 4
    assert "predictions.csv exists already: add resume=true" in capsys.readouterr().err

    # A row cut off by a hard kill is dropped and its image predicted again.
    with (run_dir / "predictions.csv").open("a") as f:
        f.write(f"{paths[4]},7,0.9")
    seen.clear()
    code, rows = predict(tiny_ckpt, str(folder), run_dir, "pictures=5", "resume=true")
    assert code == 0
    assert seen == [str(p) for p in paths[4:]]  # the first four are not predicted again
    assert [r["path"] for r in rows] == [str(p) for p in paths]
    for row in rows:
        assert row["error"] == "" and TOP3.match(row["top3"]), row
    # pictures=5 counts from the first image of the list, across the two runs.
    assert [bool(r["attention"]) for r in rows] == [True] * 5 + [False] * 4
    assert sorted(p.name for p in run_dir.glob("*_attention.png")) == [
        f"{i}_attention.png" for i in range(5)
    ]


@pytest.mark.parametrize("pictures", ["0", "2", "all"])
def test_pictures_is_how_many_images_are_drawn(tiny_ckpt, tmp_path, pictures):
    folder = tmp_path / "digits"
    for i in range(4):
        draw_digit(folder / f"{i}.png", seed=i, size=30)
    run_dir = tmp_path / "run"
    code, rows = predict(tiny_ckpt, str(folder), run_dir, f"pictures={pictures}")
    assert code == 0 and len(rows) == 4
    drawn = {"0": 0, "2": 2, "all": 4}[pictures]
    assert [r["attention"] for r in rows] == [f"{i}_attention.png" for i in range(drawn)] + [""] * (
        4 - drawn
    )
    assert len(list(run_dir.glob("*_attention.png"))) == drawn
    assert len(list(run_dir.glob("*_28x28.png"))) == drawn
    for row in rows[:drawn]:
        check_predicted(row, run_dir)


def test_pictures_must_be_a_count_or_all(tiny_ckpt, tmp_path):
    code, _ = predict(tiny_ckpt, str(tmp_path), tmp_path / "run", "pictures=-1")
    assert code == 2


def test_an_animated_image_is_predicted_from_its_first_frame_and_says_so(
    tiny_ckpt, tmp_path, caplog
):
    frames = [Image.open(draw_digit(tmp_path / f"f{i}.png", seed=i)).convert("P") for i in range(3)]
    gif = tmp_path / "moving.gif"
    frames[0].save(gif, save_all=True, append_images=frames[1:])
    module, _ = load_model(tiny_ckpt)
    (result,) = predict_images(module, [gif], tmp_path / "out", pictures=0)
    assert result.error is None and result.top and result.picture is None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [f"{gif}: an animation of 3 frames; its first frame is predicted"]


def test_the_folder_walk_names_and_skips_loops_dangling_links_and_fifos(
    tiny_ckpt, tmp_path, caplog, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    folder = Path("scans")
    good = draw_digit(folder / "good.png", seed=1, size=30)
    deep = draw_digit(folder / "sub" / "deep.png", seed=2, size=30)
    (folder / "loop_a.png").symlink_to("loop_b.png")  # a loop of two links
    (folder / "loop_b.png").symlink_to("loop_a.png")
    (folder / "sub" / "up").symlink_to("..")  # a folder that holds itself
    (folder / "gone.png").symlink_to("deleted.png")
    os.mkfifo(folder / "pipe.png")  # opening it would wait for a writer forever
    caplog.set_level(logging.INFO, logger="vit_mnist")

    paths, problems = collect_images([str(folder), "scans/**/*.png", "scans/gone.png"])

    assert paths == [good, deep] and problems == [
        ("scans/gone.png", "a dangling link (to deleted.png)")
    ]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for name, reason in [
        ("loop_a.png", "a symlink loop"),
        ("loop_b.png", "a symlink loop"),
        ("gone.png", "a dangling link (to deleted.png)"),
        ("pipe.png", "a FIFO, not an image file"),
    ]:
        assert f"scans/{name}: {reason}; skipped" in warned, warned
    assert any(m.startswith("scans/sub/up: a symlink loop") for m in warned), warned
    assert not any("up/" in str(p) for p in paths)

    code, rows = predict(tiny_ckpt, str(folder), tmp_path / "run")
    assert code == 0 and [r["path"] for r in rows] == [str(good)]


def test_a_subfolder_that_cannot_be_listed_is_named_and_skipped(tmp_path, caplog, monkeypatch):
    good = draw_digit(tmp_path / "a" / "good.png", seed=1, size=30)
    locked = tmp_path / "a" / "locked"
    draw_digit(locked / "hidden.png", seed=2, size=30)
    # As chmod 000 would do for anyone but root (the tests may run as root): listing the
    # folder fails, for glob and for the walk alike.
    real_scandir = os.scandir

    def scandir(path="."):
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(locked))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    paths, problems = collect_images(str(tmp_path / "a" / "**" / "*.png"))
    assert paths == [good] and problems == []
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [f"{locked}: a subfolder that cannot be listed (Permission denied); skipped"]


@pytest.mark.skipif(os.name != "posix", reason="file names are bytes on POSIX only")
def test_a_file_name_that_is_not_utf8_is_predicted_and_written_escaped(tiny_ckpt, tmp_path, capsys):
    """One such name among good images ended in a UnicodeEncodeError traceback with no row
    written, for the good images of its batch too. The name's bad bytes are written as
    \\xNN (vit_mnist.io.printable_path), in the CSV, the terminal and the pictures' names,
    and a resumed run finds the row again."""
    folder = tmp_path / "scans"
    draw_digit(folder / "1.png", seed=1)
    draw_digit(Path(os.fsdecode(os.fsencode(folder) + b"/7\xff.png")), seed=2)
    draw_digit(folder / "9.png", seed=3)
    run_dir = tmp_path / "run"
    code, rows = predict(tiny_ckpt, str(folder), run_dir)
    assert code == 0
    assert [r["path"] for r in rows] == [
        f"{folder}/1.png",
        f"{folder}/7\\xff.png",
        f"{folder}/9.png",
    ]
    for row in rows:
        check_predicted(row, run_dir)
    assert rows[1]["attention"] == "7\\xff_attention.png"
    assert f"{folder}/7\\xff.png: " in capsys.readouterr().out
    code, again = predict(tiny_ckpt, str(folder), run_dir, "resume=true")
    assert code == 0 and again == rows  # nothing predicted twice
