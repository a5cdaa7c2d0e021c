"""Predict digits in your own images; same as `vit-mnist-predict`.

python scripts/predict.py ckpt_path=PATH images=[a.png,b.jpg]
python scripts/predict.py ckpt_path=latest images=my_digits/          # every image in it
python scripts/predict.py ckpt_path=latest "images='scans/**/*.png'"  # a glob pattern

The run dir gets <stem>_28x28.png and <stem>_attention.png per image and predictions.csv
(path, predicted, confidence, top3, error, attention). A file that fails is reported by
name, the others are still predicted, and the exit status is 1.
"""

from vit_mnist.cli import predict

if __name__ == "__main__":
    predict()
