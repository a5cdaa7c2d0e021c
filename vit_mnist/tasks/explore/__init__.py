"""The attention explorer, a local web page: ``python scripts/explore.py ckpt_path=PATH``."""

from vit_mnist.tasks.explore.session import *  # noqa: F403 - split by the next commit
from vit_mnist.tasks.explore.session import main  # noqa: F401
