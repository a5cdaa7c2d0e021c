"""Writing files so that a killed process never leaves half of one: every writer here goes
through :func:`atomic_write_bytes` (a temporary file in the same folder, fsync, rename),
except :func:`append_csv_rows`, which grows a table by whole rows so that a long job keeps
what it has done.

What is written: raw bytes (checkpoints, IDX data files), ``metrics.json``, CSV tables,
PNG pictures from tensors and matplotlib figures.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import secrets
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # io is imported by errors, which the command line reads before torch
    import torch

log = logging.getLogger(__name__)


class WriteError(OSError):
    """A file that cannot be written (full disk, no permission); the message names it and
    says that the previous file, if there was one, is kept. Reported in one line
    (:data:`vit_mnist.errors.USER_ERRORS`), with the ``errno`` of the failed call if given."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)  # OSError(errno, message) would print "[Errno N] message"
        self.errno = errno


def printable_path(path: str | Path) -> str:
    """``path`` as text that any file, terminal or CSV takes: each byte of a name that is
    not valid UTF-8 (``os.fsdecode`` keeps it as a lone surrogate, which no UTF-8 writer
    accepts) written as ``\\xNN``, its hex value; every other character as it is. So the
    file ``b"7\\xff.png"`` is the text ``7\\xff.png`` (Python's ``backslashreplace``)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def unwritable(folder: str | Path) -> str | None:
    """Why no file can be written in ``folder`` (or, where it does not exist yet, in the
    nearest folder above it, where it would be made), or None when one can. Found by making
    one (removed at once): ``os.access`` says yes to root whatever the file system says."""
    existing = Path(folder).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        with tempfile.TemporaryFile(dir=existing):
            return None
    except OSError as e:
        return f"{printable_path(existing)}: {e.strerror or e}"


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder and a rename.

    The file gets the permissions an ordinary ``open(path, "wb")`` would give (0666 less
    the process umask, applied by the kernel when the temporary file is created), not the
    0600 of :func:`tempfile.mkstemp`, so a shared data dir or checkpoint stays readable by
    the others it was meant for.

    Raises:
        WriteError: (an ``OSError``) the folder cannot be created or written (full disk, no
            permission); the message names ``path``. The temporary file is removed and an
            earlier ``path`` is left as it was.
    """
    path, tmp = Path(path), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
        # O_EXCL: a name no other writer holds; 0o666: the umask applies, as for open().
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if not isinstance(e, OSError):
            raise
        kept = "the previous file is kept" if path.exists() else "nothing was written"
        raise WriteError(f"cannot write {path}: {e.strerror or e}; {kept}", e.errno) from e


def _plain(value: Any) -> Any:
    if hasattr(value, "numel"):  # a torch tensor
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def write_metrics(path: str | Path, metrics: dict[str, Any]) -> dict[str, Any]:
    """Write ``metrics`` as indented JSON, atomically.

    Returns:
        The metrics as written: tensors turned into Python numbers, non-finite floats
        into strings (JSON has no NaN).
    """
    clean = {k: _plain(v) for k, v in metrics.items()}
    atomic_write_bytes(path, (json.dumps(clean, indent=2, sort_keys=True) + "\n").encode())
    log.info("Metrics written to %s", path)
    return clean


def _csv_bytes(rows: Sequence[dict[str, Any]], columns: Sequence[str], header: bool) -> bytes:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns))
    if header:
        writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue().encode()


def write_csv(
    path: str | Path, rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None
) -> None:
    """Write dict rows as a CSV file with a header, atomically.

    ``columns`` defaults to the first row's keys (then ``rows`` must not be empty).
    """
    atomic_write_bytes(path, _csv_bytes(rows, columns or list(rows[0]), header=True))


def append_csv_rows(
    path: str | Path, rows: Sequence[dict[str, Any]], columns: Sequence[str]
) -> None:
    """Append dict rows to a CSV file (its header first when the file is new or empty; the
    folder is made when missing).

    The rows go out in one ``write`` on a file opened for appending, then ``fsync``: a
    signal handled in Python (Ctrl-C, SIGTERM) lands before or after them, never between
    two halves of a row. Only a hard kill or a full disk in the middle of the write can
    leave a cut-off last line, which a reader that resumes must drop (see
    :func:`vit_mnist.tasks.predict.read_done_rows`).

    Raises:
        WriteError: the file cannot be written (full disk, no permission); names ``path``.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _csv_bytes(rows, columns, header=not path.exists() or path.stat().st_size == 0)
        with path.open("ab") as f:  # O_APPEND, 0666 less the umask
            f.write(data)  # a buffered write loops until all is out (or the disk is full)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise WriteError(
            f"cannot write {path}: {e.strerror or e}; the rows before are kept", e.errno
        ) from e


def save_png(image: torch.Tensor, path: str | Path) -> None:
    """Save a (3, H, W) uint8 tensor as a PNG file, atomically."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, format="PNG")
    atomic_write_bytes(path, buffer.getvalue())


def save_figure(fig, path: str | Path) -> None:
    """Save a matplotlib ``Figure`` as PNG, atomically. The project's figures are built
    without pyplot, which holds none of them: nothing to close."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    atomic_write_bytes(path, buffer.getvalue())
