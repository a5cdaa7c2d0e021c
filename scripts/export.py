"""Export a checkpoint to ONNX or TorchScript and check it; same as `vit-mnist-export`.

python scripts/export.py ckpt_path=PATH format=onnx    # or format=torchscript
"""

from vit_mnist.cli import export

if __name__ == "__main__":
    export()
