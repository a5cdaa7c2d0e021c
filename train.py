"""Train a ViT: `python train.py [overrides]` (see configs/train.yaml); = `vit-mnist-train`."""

from vit_mnist.cli import train

if __name__ == "__main__":
    train()
