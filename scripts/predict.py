"""Predict digits in your own images; same as `vit-mnist-predict`.

python scripts/predict.py ckpt_path=PATH images=[a.png,b.jpg]
python scripts/predict.py ckpt_path=latest images=my_digits/          # every image in it
python scripts/predict.py ckpt_path=latest "images='scans/**/*.png'"  # a glob pattern

The run dir gets predictions.csv (path, predicted, confidence, top3, error, attention),
appended batch by batch, and <stem>_28x28.png and <stem>_attention.png for the first
pictures=64 images (pictures=all, or 0). A file that fails is reported by name, the others
are still predicted, and the exit status is 1. Ctrl-C or SIGTERM keeps the rows written so
far (exit 130 or 143); resume=true hydra.run.dir=<that run dir> predicts the rest.
"""

from vit_mnist.cli import predict

if __name__ == "__main__":
    predict()
