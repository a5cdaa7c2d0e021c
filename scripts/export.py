"""Export a checkpoint to ONNX, torch.export or TorchScript and check it; = `vit-mnist-export`.

python scripts/export.py ckpt_path=PATH format=onnx    # or format=exported, format=torchscript
python scripts/export.py ckpt_path=PATH output=model.onnx overwrite=true

An existing output file is kept (one error line, exit status 2) unless overwrite=true, and
an output must end in the format's suffix: .onnx, .pt2 for exported, .pt for torchscript.
"""

from vit_mnist.cli import export

if __name__ == "__main__":
    export()
