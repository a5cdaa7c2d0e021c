"""What the command line prints: every log line once, in Hydra's format, without vendor tips
or third-party deprecation notices the user cannot act on."""

from __future__ import annotations

import logging
import warnings

# Narrow on purpose: the message and the module of each notice, so that any other warning
# still shows.
_IGNORED_WARNINGS = (
    # torch deprecates the pytree API that Lightning still calls; nothing for the user to do.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\."),
    # The model summary counts bf16 parameters at 32 bits; the parameter count is exact.
    (r"Precision bf16-mixed is not supported by the model summary", r"lightning\.pytorch\."),
    # Epochs shorter than log_every_n_steps: ViTClassifier.on_train_start then logs every
    # step, so train/loss is logged anyway.
    (
        r"The number of training batches \(\d+\) is smaller than the logging interval",
        r"lightning\.pytorch\.",
    ),
    # Every resume writes into a new run dir, so Lightning notes each time that the old
    # dir's checkpoint scores are not reloaded; val/acc_best itself is restored by
    # ViTClassifier.
    (r"The dirpath has changed from", r"lightning\.pytorch\.callbacks\.model_checkpoint"),
)


def _no_vendor_tip(record: logging.LogRecord) -> bool:
    """False for Lightning's advertisement for a cloud logger (a logging filter)."""
    return "💡 Tip" not in record.getMessage()


def quiet_console() -> None:
    """Call once Hydra has set up logging and Lightning is imported.

    Lightning gives its ``lightning`` logger a console handler of its own, so under Hydra
    (whose root handler prints and writes ``<run dir>/<task>.log``) each Lightning line was
    printed twice: once as ``INFO: ...`` and once in Hydra's format. Its handlers go; its
    records still reach Hydra's.
    """
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    # addFilter adds a filter once, however often this is called.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_no_vendor_tip)
    for message, module in _IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module)


def progress(total: int, description: str, *, enabled: bool = True):
    """A progress bar of ``total`` steps on stderr, tqdm's (the one Lightning's
    ``TQDMProgressBar`` draws in training): silent when stderr is not a terminal (a log
    file, a test) or ``enabled`` is False (``trainer.enable_progress_bar=false``). Call
    ``.update()`` per step and ``.close()`` at the end, or use it in a ``with``."""
    from tqdm import tqdm

    return tqdm(total=total, desc=description, disable=None if enabled else True, leave=False)
