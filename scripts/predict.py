"""Predict digits in your own images.

python scripts/predict.py ckpt_path=PATH images=[a.png,b.jpg]
"""

import hydra

import vit_mnist.predict


@hydra.main(version_base="1.3", config_path="../configs", config_name="predict")
def main(cfg):
    vit_mnist.predict.main(cfg)


if __name__ == "__main__":
    main()
