"""``python eval.py``: a checkpoint's test and report (``report.py``), and the analyses of
its heads (``analyses.py``)."""

from vit_mnist.tasks.evaluate.report import evaluate, main

__all__ = ["evaluate", "main"]
