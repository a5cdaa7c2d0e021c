"""Evaluate a checkpoint: `python eval.py ckpt_path=PATH` (see configs/eval.yaml); same as
`vit-mnist-eval`."""

from vit_mnist.cli import evaluate

if __name__ == "__main__":
    evaluate()
