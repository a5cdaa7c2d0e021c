"""Drive the attention explorer from a real browser: its picture and its latency.

python scripts/explorer_browser.py CKPT --shot docs/explorer.png --report docs/explorer.md

Starts the explorer of CKPT on the loopback, opens it in headless Chromium (Debian's
``/usr/bin/chromium`` through Playwright: ``pip install playwright``, no browser download),
takes a screenshot of the page, then times 20 input changes (a new test image index typed
in) from the key press to the updated page (the summary line names the new image and the
model view's picture has loaded), and writes the median with the CPU into the report.
The helpers here are the ones ``tests/test_explorer_browser.py`` uses.
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

import torch
from omegaconf import OmegaConf

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
    """(explorer, url): the explorer of ``ckpt`` served on 127.0.0.1, a free port."""
    from vit_mnist.explorer import build_page, launch, load_explorer

    cfg = OmegaConf.create(
        {
            "ckpt_path": str(ckpt),
            "heads_csv": None,
            "data": None,
            "paths": {"log_dir": "outputs", "data_dir": str(data_dir)},
        }
    )
    explorer = load_explorer(cfg)
    page = build_page(explorer)
    url = launch(page)
    try:
        yield explorer, url
    finally:
        page.close()


def summary(page) -> str:
    return page.locator("#summary").inner_text()


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


def open_test_tab(page) -> None:
    page.get_by_role("tab", name="Test image").click()


def latency(page, indices: list[int]) -> list[float]:
    """Seconds from typing each test index to the updated page, one per index."""
    times = []
    for i in indices:
        start = time.perf_counter()
        show_test_image(page, i)
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", help="a checkpoint (best-*.ckpt of a train.py run)")
    parser.add_argument("--shot", default="docs/explorer.png", help="the screenshot (PNG)")
    parser.add_argument("--report", default="docs/explorer.md", help="the latency page")
    parser.add_argument("--caption", default="", help="a line about the checkpoint")
    parser.add_argument("--changes", type=int, default=20, help="input changes timed")
    args = parser.parse_args(argv)
    missing = browser_missing()
    if missing:
        print(f"error: {missing}")
        return 2
    from vit_mnist.hardware import cpu_class, cpu_name
    from vit_mnist.io import atomic_write_bytes

    torch.set_num_threads(1)  # as scripts/explore.py runs
    load_before = os.getloadavg()[0]
    with running_explorer(args.ckpt) as (_, url), chromium_page() as page:
        page.goto(url)
        open_test_tab(page)
        show_test_image(page, 0)  # the first change loads fonts and warms the model
        times = latency(page, list(range(1, args.changes + 1)))
        # The picture: a digit with one head switched off, its query patch chosen.
        show_test_image(page, 0)
        page.locator("#heads-layer-5 label", has_text="head 1").click()
        wait_for_summary(page, "1 head off")
        box = page.locator("#seen img").bounding_box()
        # A patch left of the middle: the query view shows where it attends.
        page.locator("#seen img").click(
            position={"x": box["width"] * 0.4, "y": box["height"] * 0.5}
        )
        page.wait_for_timeout(2000)  # the query view's and the other pictures' loading
        png = page.screenshot(full_page=True)
    load_after = os.getloadavg()[0]
    atomic_write_bytes(Path(args.shot), png)
    import gradio

    ms = sorted(1000 * t for t in times)
    median = statistics.median(ms)
    text = f"""# The attention explorer: latency

`python scripts/explorer_browser.py {args.ckpt} --shot {args.shot} --report {args.report}`
on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: {cpu_name()}, class {cpu_class()}
({torch.get_num_threads()} torch thread; {os.cpu_count()} cores, shared with other programs
that were running at the time: load average {load_before:.1f} before, {load_after:.1f} after),
torch {torch.__version__}, Gradio {gradio.__version__}, Python {platform.python_version()},
headless Chromium on the same machine. {args.caption}

Each of {len(ms)} input changes types a new test image index into the page; the time runs
from the key press to the updated page: the summary line names the new image and the model
view's picture (every layer x head) has loaded. Every change recomputes the prediction, all
maps, the rollout and the class relevance (one forward and one backward pass).

| input changes | median (ms) | fastest (ms) | slowest (ms) | under 300 ms |
| --- | --- | --- | --- | --- |
| {len(ms)} | {median:.0f} | {ms[0]:.0f} | {ms[-1]:.0f} | {sum(m < 300 for m in ms)} of {len(ms)} |

All times (ms, sorted): {", ".join(f"{m:.0f}" for m in ms)}.
"""
    atomic_write_bytes(Path(args.report), text.encode())
    print(f"median {median:.0f} ms over {len(ms)} changes; {args.shot}, {args.report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
