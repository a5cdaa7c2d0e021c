"""The attention explorer in your browser; same as `vit-mnist-explore`.

python scripts/explore.py ckpt_path=latest
python scripts/explore.py ckpt_path=PATH heads_csv=<eval run>/head_importance.csv

Prints the page's address (http://127.0.0.1:7860 unless that port is taken); Ctrl-C stops it.
"""

from vit_mnist.cli import explore

if __name__ == "__main__":
    explore()
