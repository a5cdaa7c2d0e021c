"""Drive the attention explorer from a real browser: its picture and its latency.

python scripts/explorer_browser.py CKPT --shot docs/explorer.png --report docs/explorer.md

Starts the explorer of CKPT on the loopback, opens it in headless Chromium (Debian's
``/usr/bin/chromium`` through Playwright: ``pip install playwright``, no browser download),
times 20 input changes of each kind (a new test image, a head switched off or on, a patch
clicked, a stroke drawn) from the input to the updated page, writes their medians and
worsts with the CPU into the report, and takes a screenshot of the page with a head
switched off. The helpers here are the ones ``tests/test_explorer_browser.py`` uses.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
# No sandbox (containers run as root), no GPU, nothing fetched in the background.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TIMEOUT_MS = 15_000


def browser_missing() -> str | None:
    """Why the browser cannot run here, or None when it can."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (pip install -e '.[dev]')"
    if not CHROMIUM.exists():
        return f"no {CHROMIUM} (apt-get install chromium)"
    return None


@contextmanager
def chromium_page(width: int = 1500, height: int = 1200) -> Iterator:
    """A Playwright page in headless Chromium."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(TIMEOUT_MS)
            yield page
        finally:
            browser.close()


@contextmanager
def running_explorer(ckpt: str | Path, data_dir: str | Path = "data") -> Iterator[tuple]:
    """(explorer, url, page): the explorer of ``ckpt`` served on 127.0.0.1, a free port,
    and its Gradio page (closed on the way out)."""
    from omegaconf import OmegaConf

    from vit_mnist.tasks.explore import build_page, launch, load_explorer

    cfg = OmegaConf.create(
        {
            "ckpt_path": str(ckpt),
            "heads_csv": None,
            "max_upload_megapixels": 25,
            "data": None,
            "paths": {"log_dir": "outputs", "data_dir": str(data_dir)},
        }
    )
    explorer = load_explorer(cfg)
    page = build_page(explorer)
    url = launch(page)
    try:
        yield explorer, url, page
    finally:
        page.close()


def summary(page) -> str:
    return page.locator("#summary").inner_text()


def picture(page, elem_id: str) -> str:
    """The address of the picture now shown in the panel ``elem_id`` ("" for none)."""
    found = page.locator(f"#{elem_id} img")
    return (found.first.get_attribute("src") or "") if found.count() else ""


def wait_for_picture(page, elem_id: str, old: str) -> None:
    """Wait until the panel ``elem_id`` shows a picture other than ``old``, loaded."""
    page.wait_for_function(
        """([id, old]) => {
            const img = document.querySelector(`#${id} img`);
            return img && img.getAttribute('src') !== old && img.complete
                && img.naturalWidth > 0;
        }""",
        arg=[elem_id, old],
    )


def wait_for_summary(page, text: str) -> str:
    """Wait until the summary line holds ``text`` and the model view's picture has loaded;
    returns the summary."""
    page.wait_for_function(
        """text => {
            const s = document.querySelector('#summary');
            const img = document.querySelector('#model-view img');
            return s && s.innerText.includes(text) && img && img.complete
                && img.naturalWidth > 0;
        }""",
        arg=text,
    )
    return summary(page)


def show_test_image(page, index: int) -> str:
    """Type ``index`` into the test-image box; returns the updated summary line."""
    box = page.locator("#test-index input")
    box.fill(str(index))  # one input event, as typing the number and leaving the box
    return wait_for_summary(page, f"test image {index} ")


def open_tab(page, name: str) -> None:
    page.get_by_role("tab", name=name).click()


def stroke(page, start: tuple[float, float], end: tuple[float, float]) -> None:
    """Draw a line on the Draw tab's canvas from ``start`` to ``end``, in fractions of its
    width and height."""
    box = page.locator("#sketch canvas").first.bounding_box()

    def at(point):
        return box["x"] + point[0] * box["width"], box["y"] + point[1] * box["height"]

    page.mouse.move(*at(start))
    page.mouse.down()
    page.mouse.move(*at(end), steps=10)
    page.mouse.up()


# What the report says each kind of change is; the same as latency()'s docstring.
LATENCY_KINDS = """Each kind of input change is timed from the input (a key press, a click, the
mouse's release after a stroke) to the updated page in headless Chromium: the picture that
the change redraws has been received and decoded.

- **image**: a new test image index typed in; the summary names it and the model view
  (every layer x head) has loaded. The model runs once (one forward and one backward pass
  for the relevance) and every panel is redrawn.
- **head**: head 1 of layer 0 switched off or on; the new model view has loaded. As image.
- **patch**: a click on another patch of the input; the new query view has loaded. The
  model does not run: the query view, the input and the matrix are redrawn from the
  session's last explanation.
- **stroke**: a line drawn on a cleared canvas, from the mouse's release; the new model view
  has loaded. The drawing goes with the event (no upload), then as image."""


def timed(change, wait) -> float:
    """Seconds from ``change()`` (one input) to the end of ``wait()`` (the page updated)."""
    start = time.perf_counter()
    change()
    wait()
    return time.perf_counter() - start


# The kinds of input change timed, and the latency each should keep to on a 2-core CPU
# (ms: median, slowest), as issue 80 asks; None: no bound asked.
WHERE_THE_TIME_GOES = """Where an image change's time goes (an earlier profile, under load, as
shares): about a third on the server (the model's one forward and backward pass 6-10 ms, the
pictures drawn 20-30 ms, Gradio's PNG encoding of them about 30 ms), two thirds in and
between the browser's requests (the input reaching the server, the page fetching and decoding
each picture). A stroke is an image change whose drawing comes with the event: the Draw
tab's canvas sends it as one PNG data URL at the mouse's release. Gradio's Sketchpad, which
the page used before, first rendered and uploaded three PNGs: 0.9-1.4 s from the release to
its upload on a bare Gradio page with an empty handler, about a second a stroke in all."""

TARGETS = {
    "image": (200, 400),
    "head": (200, 400),
    "patch": (None, None),
    "stroke": (500, 500),
}


def latency(page, changes: int, grid: int) -> dict[str, list[float]]:
    """Seconds from each input change to the updated page, ``changes`` of each kind of
    :data:`TARGETS` (described in :data:`LATENCY_KINDS`); ``grid``: patches per side."""
    times: dict[str, list[float]] = {kind: [] for kind in TARGETS}
    open_tab(page, "Test image")
    show_test_image(page, 0)  # the first change loads fonts and warms the model
    box = page.locator("#test-index input")
    for i in range(1, changes + 1):
        times["image"].append(
            timed(lambda i=i: box.fill(str(i)), lambda i=i: wait_for_summary(page, f"image {i} "))
        )
    head = page.locator("#heads-layer-0 label", has_text="head 1")
    for _ in range(changes):
        old = picture(page, "model-view")
        times["head"].append(
            timed(head.click, lambda old=old: wait_for_picture(page, "model-view", old))
        )
    seen = page.locator("#seen img")
    size = seen.bounding_box()
    for i in range(changes):
        r, c = divmod(5 * (i + 1) % grid**2, grid)  # each click another patch
        at = {"x": size["width"] * (c + 0.5) / grid, "y": size["height"] * (r + 0.5) / grid}
        old = picture(page, "query-view")
        times["patch"].append(
            timed(
                lambda at=at: seen.click(position=at),
                lambda old=old: wait_for_picture(page, "query-view", old),
            )
        )
    open_tab(page, "Draw")
    for i in range(changes):
        if i:  # the last drawing's panels emptied
            page.get_by_role("button", name="Clear canvas").click()
            page.wait_for_function("() => !document.querySelector('#model-view img')")
        old = picture(page, "model-view")
        # A line at its own angle, drawn before the clock starts.
        canvas = page.locator("#sketch canvas").first.bounding_box()
        x0, x1 = 0.3, 0.3 + 0.4 * i / max(1, changes - 1)
        page.mouse.move(canvas["x"] + x0 * canvas["width"], canvas["y"] + 0.2 * canvas["height"])
        page.mouse.down()
        page.mouse.move(
            canvas["x"] + x1 * canvas["width"], canvas["y"] + 0.8 * canvas["height"], steps=10
        )
        times["stroke"].append(
            timed(page.mouse.up, lambda old=old: wait_for_picture(page, "model-view", old))
        )
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", help="a checkpoint (best-*.ckpt of a train.py run)")
    parser.add_argument("--shot", default="docs/explorer.png", help="the screenshot (PNG)")
    parser.add_argument("--report", default="docs/explorer.md", help="the latency page")
    parser.add_argument("--caption", default="", help="a line about the checkpoint")
    parser.add_argument("--changes", type=int, default=20, help="input changes timed")
    parser.add_argument(
        "--size", default="1400x900", help="the browser window, WIDTHxHEIGHT in CSS px"
    )
    args = parser.parse_args(argv)
    missing = browser_missing()
    if missing:
        print(f"error: {missing}")
        return 2
    import torch  # after the parse: --help answers at once

    from vit_mnist.hardware import cpu_class, cpu_name
    from vit_mnist.io import atomic_write_bytes

    torch.set_num_threads(1)  # as scripts/explore.py runs
    load_before = os.getloadavg()[0]
    width, height = map(int, args.size.split("x"))
    with running_explorer(args.ckpt) as (explorer, url, _), chromium_page(width, height) as page:
        page.goto(url)
        wait_for_summary(page, "example 0")
        times = latency(page, args.changes, explorer.model.patch_embed.grid_size)
        # The picture: a test digit with one head switched off, a patch queried, a head's
        # attention matrix shown.
        open_tab(page, "Test image")
        show_test_image(page, 0)
        page.locator("#heads-layer-5 label", has_text="head 1").click()
        wait_for_summary(page, "1 head off")
        box = page.locator("#seen img").bounding_box()
        # A patch left of the middle: the query view shows where it attends.
        page.locator("#seen img").click(
            position={"x": box["width"] * 0.4, "y": box["height"] * 0.5}
        )
        page.locator("#matrix-head input").click()
        page.get_by_role("option", name="head 1").click()
        wait_for_picture(page, "matrix", "")
        # The logit lens is drawn by the browser (an SVG line plot) after the data arrive.
        page.wait_for_function("() => document.querySelectorAll('#lens .mark-line path').length")
        page.wait_for_timeout(2000)  # the other pictures' loading
        png = page.screenshot(full_page=True)
    load_after = os.getloadavg()[0]
    atomic_write_bytes(Path(args.shot), png)
    import gradio

    rows = []
    for kind, (median_bound, worst_bound) in TARGETS.items():
        ms = sorted(1000 * t for t in times[kind])
        median = statistics.median(ms)
        bound = (
            f"median under {median_bound}, worst under {worst_bound}"
            if median_bound and median_bound != worst_bound
            else f"all under {worst_bound}"
            if worst_bound
            else "-"
        )
        met = (
            "-"
            if not worst_bound
            else "yes"
            if median < median_bound and ms[-1] < worst_bound
            else "no"
        )
        rows.append(f"| {kind} | {len(ms)} | {median:.0f} | {ms[-1]:.0f} | {bound} | {met} |")
        print(f"{kind}: median {median:.0f} ms, worst {ms[-1]:.0f} ms over {len(ms)} changes")
    table = "\n".join(rows)
    text = f"""# The attention explorer: latency

`python scripts/explorer_browser.py {args.ckpt} --shot {args.shot} --report {args.report}`
on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: {cpu_name()}, class {cpu_class()}
({torch.get_num_threads()} torch thread; {os.cpu_count()} cores, shared with other programs
that were running at the time: load average {load_before:.1f} before, {load_after:.1f} after),
torch {torch.__version__}, Gradio {gradio.__version__}, Python {platform.python_version()},
headless Chromium on the same machine. {args.caption}

{LATENCY_KINDS}

| input change | changes | median (ms) | worst (ms) | asked (ms) | met |
| --- | --- | --- | --- | --- | --- |
{table}

{WHERE_THE_TIME_GOES}
"""
    atomic_write_bytes(Path(args.report), text.encode())
    print(f"{args.shot}, {args.report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
