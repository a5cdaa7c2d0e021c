"""Train a ViT: `python train.py [overrides]` (see configs/train.yaml)."""

import hydra

import vit_mnist.train


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg):
    vit_mnist.train.main(cfg)


if __name__ == "__main__":
    main()
