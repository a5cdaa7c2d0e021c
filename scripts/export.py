"""Export a checkpoint to ONNX or TorchScript and check it; same as `vit-mnist-export`.

python scripts/export.py ckpt_path=PATH format=onnx    # or format=torchscript
python scripts/export.py ckpt_path=PATH output=model.onnx overwrite=true

An existing output file is kept (one error line, exit status 2) unless overwrite=true, and
an output must end in the format's suffix: .onnx for onnx, .pt for torchscript.
"""

from vit_mnist.cli import export

if __name__ == "__main__":
    export()
