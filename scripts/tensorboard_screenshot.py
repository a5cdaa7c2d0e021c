"""Screenshot TensorBoard's Images tab for a run, in headless Chromium (Debian: `chromium`).

python scripts/tensorboard_screenshot.py outputs/train/runs/<run> --out docs/tensorboard.png

Starts TensorBoard on 127.0.0.1 (nothing leaves this machine), opens the Images tab
filtered to the per-layer attention panels and the rollout, and saves a PNG. The cards
keep TensorBoard's default size (350 px wide, "Show actual image size" off) and the
window its device scale factor 1, so the picture shows the labels as a user sees them.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path

# `python scripts/tensorboard_screenshot.py` puts scripts/ on the path, not the checkout
# whose tests/ holds the server helper that the TensorBoard test uses too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.tensorboard_server import serve, wait_for_tags  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run dir of train.py (holds tensorboard/)")
    parser.add_argument("--out", type=Path, default=Path("docs/tensorboard.png"))
    parser.add_argument("--tag-filter", default="attention/layer|rollout", help="a tag regex")
    parser.add_argument("--size", default="1600,1200", help="window width,height in pixels")
    parser.add_argument("--browser", default="chromium", help="chromium or google-chrome")
    args = parser.parse_args(argv)

    browser = shutil.which(args.browser)
    if browser is None:
        print(f"error: {args.browser} not found; apt-get install chromium", file=sys.stderr)
        return 2
    if not args.run_dir.is_dir():
        print(f"error: run dir {args.run_dir} does not exist", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with serve(args.run_dir) as url:
        tags = wait_for_tags(url, "images", {"rollout"})
        if not any(tags.values()):
            print(f"error: {args.run_dir} holds no TensorBoard images", file=sys.stderr)
            return 2
        page = f"{url}?darkMode=false#images&tagFilter={urllib.parse.quote(args.tag_filter)}"
        tmp = args.out.with_name(f".{args.out.name}.tmp.png")
        subprocess.run(
            [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
            + ["--force-device-scale-factor=1"]
            + [f"--window-size={args.size}", "--virtual-time-budget=20000"]
            + [f"--screenshot={tmp.resolve()}", page],
            check=True,
            capture_output=True,
            timeout=120,
        )
        tmp.replace(args.out)
    print(f"wrote {args.out} ({page})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
