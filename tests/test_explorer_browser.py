"""The attention explorer in a real browser: headless Chromium (Debian's package) through
Playwright, on the loopback address. Skipped, with the reason, where either is missing."""

from __future__ import annotations

import pytest
import torch

from scripts.explorer_browser import (
    browser_missing,
    chromium_page,
    running_explorer,
    wait_for_summary,
)
from tests.test_explorer import save_ckpt, tiny_module
from tests.test_predict import draw_digit

MISSING = browser_missing()

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(MISSING is not None, reason=f"no browser here: {MISSING}"),
]


def test_upload_predict_and_switch_a_head_off(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as scripts/explore.py runs
    ckpt = save_ckpt(tmp_path / "tiny.ckpt", tiny_module())
    digit = draw_digit(tmp_path / "digit.png", seed=3)
    try:
        with running_explorer(ckpt) as (explorer, url), chromium_page() as page:
            assert url.startswith("http://127.0.0.1:")
            page.goto(url)
            # Draw tab: with the brush picked (the canvas asks for it), a stroke reaches
            # the model as a drawing.
            page.get_by_role("button", name="Brush").click()
            box = page.locator("canvas").first.bounding_box()
            x0, y0 = box["x"] + box["width"] / 2, box["y"] + box["height"] * 0.2
            page.mouse.move(x0, y0)
            page.mouse.down()
            page.mouse.move(x0, y0 + box["height"] * 0.6, steps=20)
            page.mouse.up()
            assert "predicted: " in wait_for_summary(page, "drawing: ")
            page.get_by_role("tab", name="Upload").click()
            page.set_input_files("#upload input[type=file]", str(digit))
            text = wait_for_summary(page, "digit.png")
            x = explorer.from_file(digit)
            predicted = explorer.class_names[explorer.view(x).explanation.predicted]
            assert f"predicted: {predicted} (" in text, text
            picture = page.locator("#model-view img").get_attribute("src")
            page.locator("#heads-layer-1 label", has_text="head 2").click()
            text = wait_for_summary(page, "1 head off")
            off = explorer.view(x, heads_off=[(1, 2)]).explanation
            assert f"-> {100 * float(off.probs[off.base_probs.argmax()]):.1f}%" in text, text
            assert page.locator("#model-view img").get_attribute("src") != picture
    finally:
        torch.set_num_threads(threads)
