"""The attention explorer in a real browser: headless Chromium (Debian's package) through
Playwright, on the loopback address. Skipped, with the reason, where either is missing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scripts.explorer_browser import (
    browser_missing,
    chromium_page,
    open_tab,
    running_explorer,
    stroke,
    wait_for_summary,
)
from tests.test_explorer import save_ckpt, tiny_module
from tests.test_predict import draw_digit

MISSING = browser_missing()

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(MISSING is not None, reason=f"no browser here: {MISSING}"),
]


def test_draw_clear_upload_and_switch_a_head_off(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as scripts/explore.py runs
    ckpt = save_ckpt(tmp_path / "tiny.ckpt", tiny_module())
    digit = draw_digit(tmp_path / "digit.png", seed=3)
    try:
        with running_explorer(ckpt) as (explorer, url, served), chromium_page() as page:
            assert url.startswith("http://127.0.0.1:")
            page.goto(url)
            wait_for_summary(page, "example 0")
            # Draw tab: a stroke right after the page opens reaches the model as a drawing.
            stroke(page, (0.5, 0.2), (0.5, 0.8))
            assert "predicted: " in wait_for_summary(page, "drawing: ")
            # Clearing the canvas clears the panels; the next stroke draws again.
            page.get_by_role("button", name="Clear canvas").click()
            page.wait_for_function(
                "() => !document.querySelector('#summary').innerText.trim()"
                " && !document.querySelector('#model-view img')"
            )
            stroke(page, (0.3, 0.3), (0.7, 0.7))
            assert "predicted: " in wait_for_summary(page, "drawing: ")
            open_tab(page, "Upload")
            page.set_input_files("#upload input[type=file]", str(digit))
            text = wait_for_summary(page, "digit.png")
            x = explorer.from_file(digit)
            predicted = explorer.class_names[explorer.view(x).explanation.predicted]
            assert f"predicted: {predicted} (" in text, text
            picture = page.locator("#model-view img").get_attribute("src")
            writes = page.locator("#writes img").get_attribute("src")
            page.locator("#heads-layer-1 label", has_text="head 2").click()
            text = wait_for_summary(page, "1 head off")
            off = explorer.view(x, heads_off=[(1, 2)]).explanation
            assert f"-> {100 * float(off.probs[off.base_probs.argmax()]):.1f}%" in text, text
            assert page.locator("#model-view img").get_attribute("src") != picture
            # What each head writes: the head switched off changes the attribution shown.
            assert page.locator("#writes img").get_attribute("src") not in (None, writes)
            assert page.locator("#lens").is_visible()
            made = {Path(f) for files in served.temp_file_sets for f in files}
            # Gradio keeps the pictures the page is built with (the examples): the same
            # files at every start.
            made -= {Path(f) for b in served.blocks.values() for f in b.keep_in_cache}
        # The upload, the drawings and the pictures sent are deleted once the page closes.
        assert any(f.name == "digit.png" for f in made)
        assert [f for f in made if f.exists()] == []
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("width", [1024, 1400, 1920])
def test_the_gallery_shows_all_ten_examples_at_common_widths(tmp_path, width):
    """Issue 102: at 1 400 px wide the examples gallery showed 8 of its 10 digits (the 4
    and the 9 cut off on the right). Every example is now whole inside the gallery."""
    ckpt = save_ckpt(tmp_path / "tiny.ckpt", tiny_module())
    with running_explorer(ckpt) as (explorer, url, _), chromium_page(width, 900) as page:
        page.goto(url)
        wait_for_summary(page, "example 0")
        boxes = page.evaluate(
            """() => {
                const wrap = document.querySelector('#examples .grid-wrap').getBoundingClientRect();
                const tiles = [...document.querySelectorAll('#examples img')];
                return [[wrap.left, wrap.right, wrap.top], tiles.map(i => {
                    const r = i.getBoundingClientRect();
                    return [r.left, r.right, r.top, r.width];
                })];
            }"""
        )
    (left, right, top), tiles = boxes
    assert len(tiles) == len(explorer.examples[0]) == 10
    assert all(left <= a and b <= right + 0.5 and t >= top and w > 20 for a, b, t, w in tiles)
