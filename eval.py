"""Evaluate a checkpoint: `python eval.py ckpt_path=PATH` (see configs/eval.yaml)."""

import hydra

import vit_mnist.evaluate


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def main(cfg):
    vit_mnist.evaluate.main(cfg)


if __name__ == "__main__":
    main()
