"""Draw attention rollout beside class relevance maps for a few test digits.

    python scripts/relevance_figure.py outputs/train/runs/<run>/checkpoints/<best>.ckpt \\
        --out docs/relevance.png

One column per test digit (the first test image of each of the first ``--digits`` classes),
titled ``true>predicted``; rows: the input, attention rollout (Abnar and Zuidema 2020, the
same for every class), class relevance (Chefer, Gur and Wolf 2021) for the predicted class,
and class relevance for the runner-up class (the second-highest logit, named in the column
title after ``|``). Each map is scaled to its own range and overlaid on the digit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint written by train.py")
    parser.add_argument("--out", type=Path, default=Path("docs/relevance.png"))
    parser.add_argument("--data-dir", default="data", help="where the dataset's files are")
    parser.add_argument("--digits", type=int, default=8, help="columns: one per class, 1..10")
    args = parser.parse_args(argv)
    # After the parse: --help answers without loading torch.
    import hydra
    import torch
    from omegaconf import OmegaConf

    from vit_mnist.analysis import attention_rollout, class_relevance, cls_attention
    from vit_mnist.analysis.drawing import grey, labelled_grid, overlay
    from vit_mnist.errors import CheckpointError
    from vit_mnist.io import save_png
    from vit_mnist.training.checkpointing import load_model

    try:
        module, data = load_model(args.checkpoint)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not data:
        print(f"error: {args.checkpoint} stores no data config", file=sys.stderr)
        return 2
    if "data_dir" in data:  # the training machine's folder may not exist here
        data = {**data, "data_dir": args.data_dir}
    datamodule = hydra.utils.instantiate(OmegaConf.create(data))
    datamodule.prepare_data()
    datamodule.setup("test")
    x, y = datamodule.data_test.tensors
    picks = [int(torch.nonzero(y == c)[0]) for c in range(min(args.digits, 10))]
    images = datamodule.data_test.normalise(x[picks].cpu())
    labels = y[picks].cpu()

    model = module.net
    with torch.no_grad():
        logits, weights = model.forward_with_attention(images)
    runner_up = logits.topk(2, dim=1).indices[:, 1]
    grid = model.patch_embed.grid_size
    rollout = cls_attention(attention_rollout(weights), grid)
    predicted_map, predicted = class_relevance(model, images)
    second_map, _ = class_relevance(model, images, runner_up)

    names = list(getattr(datamodule, "class_names", None) or map(str, range(logits.shape[1])))
    tiles = torch.stack(
        [
            grey(images),
            overlay(images, rollout),
            overlay(images, predicted_map),
            overlay(images, second_map),
        ]
    )  # (rows, cols, 3, H, W)
    picture = labelled_grid(
        tiles,
        row_labels=["input", "rollout", "relevance: predicted", "relevance: runner-up"],
        col_labels=[
            f"{names[t]}>{names[p]} | {names[r]}"
            for t, p, r in zip(labels.tolist(), predicted.tolist(), runner_up.tolist(), strict=True)
        ],
        title="rollout vs. class relevance (Chefer et al. 2021); true>predicted | runner-up",
    )
    save_png(picture, args.out)
    print(f"wrote {args.out} ({picture.shape[2]} x {picture.shape[1]} px)")
    for t, p, r, z in zip(labels, predicted, runner_up, logits, strict=True):
        print(
            f"true {names[t]}: predicted {names[p]} (logit {z[p]:.2f}), "
            f"runner-up {names[r]} (logit {z[r]:.2f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
