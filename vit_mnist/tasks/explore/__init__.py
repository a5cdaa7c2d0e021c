"""The attention explorer, a local web page: ``python scripts/explore.py ckpt_path=PATH``.

``session``: the checkpoint's model and every computation the page shows (:class:`Explorer`);
``page``: the page, panel by panel, and its event handlers; ``server``: the address, the
launch and ``main``; ``sketch.js``: the Draw tab's canvas.

Safe by default: bound to 127.0.0.1 unless ``server_name`` says otherwise (then a warning),
Gradio's telemetry off, uploads limited to ``max_upload_mb`` and ``max_upload_megapixels``
and read with ``predict.py``'s guards, files taken as uploads only (never fetched from a
URL), uploads and drawings deleted when the page stops, and no file served but the
pictures the page makes.
"""

from vit_mnist.tasks.explore.page import build_page
from vit_mnist.tasks.explore.server import check_address, launch, main
from vit_mnist.tasks.explore.session import (
    Explorer,
    View,
    load_explorer,
    original_heads,
    read_head_table,
)

__all__ = [
    "Explorer",
    "View",
    "build_page",
    "check_address",
    "launch",
    "load_explorer",
    "main",
    "original_heads",
    "read_head_table",
]
