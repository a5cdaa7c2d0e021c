"""Make the README's attention picture from a training run's TensorBoard event files.

    python scripts/attention_figure.py outputs/train/runs/<run> --out docs/attention.png

Reads the last logged step of ``attention/layer_*`` and ``rollout`` with TensorBoard's own
``EventAccumulator`` and stacks them, first layer at the top, into one PNG.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
from pathlib import Path

from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def last_images(run_dir: Path) -> dict[str, bytes]:
    """The newest PNG of every image tag in ``<run_dir>/tensorboard``."""
    found: dict[str, tuple[int, bytes]] = {}
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(path), size_guidance={"images": 0})
        acc.Reload()
        for tag in acc.Tags()["images"]:
            event = acc.Images(tag)[-1]
            if tag not in found or event.step >= found[tag][0]:
                found[tag] = (event.step, event.encoded_image_string)
    return {tag: png for tag, (_, png) in found.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a train run dir (holds tensorboard/)")
    parser.add_argument("--out", type=Path, default=Path("docs/attention.png"))
    parser.add_argument(
        "--layers", type=int, nargs="*", help="layers to show (default: first and last)"
    )
    args = parser.parse_args(argv)

    images = last_images(args.run_dir)
    layer_tags = sorted(
        (t for t in images if re.fullmatch(r"attention/layer_\d+", t)),
        key=lambda t: int(t.rsplit("_", 1)[1]),
    )
    if not layer_tags or "rollout" not in images:
        print(
            f"error: no attention images in {args.run_dir / 'tensorboard'}; "
            "train with the attention_maps callback on (the default)",
            file=sys.stderr,
        )
        return 2
    wanted = args.layers if args.layers else sorted({0, len(layer_tags) - 1})
    tags = [f"attention/layer_{i}" for i in wanted] + ["rollout"]
    pictures = [Image.open(io.BytesIO(images[t])).convert("RGB") for t in tags]
    width = max(p.width for p in pictures)
    figure = Image.new("RGB", (width, sum(p.height for p in pictures)), "white")
    y = 0
    for p in pictures:
        figure.paste(p, (0, y))
        y += p.height
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.save(args.out)
    print(f"wrote {args.out} ({figure.width} x {figure.height} px) from {', '.join(tags)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
