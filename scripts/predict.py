"""Predict digits in your own images; same as `vit-mnist-predict`.

python scripts/predict.py ckpt_path=PATH images=[a.png,b.jpg]
"""

from vit_mnist.cli import predict

if __name__ == "__main__":
    predict()
