"""A LightningDataModule over in-memory tensors: the whole of MNIST is 47 MB as uint8.

The fast path: the images stay uint8 in one tensor (moved to the GPU when training
there); each batch is gathered with one indexing call and normalised with tensor ops on
the tensor's device, then augmented on the device (``on_after_batch_transfer``). No
per-image Python, PIL or collate work. Any other map-style dataset (a user's own, a
torchvision dataset with per-sample transforms) goes through the same DataLoader with
PyTorch's default per-sample collation.
"""

from __future__ import annotations

import logging

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchvision.transforms.v2 import functional as TF

from vit_mnist.data.augment import BatchAugment
from vit_mnist.errors import ConfigError

log = logging.getLogger(__name__)


class ImageTensorDataset(TensorDataset):
    """Images and labels held as two tensors, served a whole batch at a time.

    ``DataLoader`` calls ``__getitems__`` with a batch of indices (PyTorch >= 2.1): one
    gather of the uint8 images, then one normalisation of the batch, on whatever device
    the tensors live. ``dataset[i]`` gives one normalised image for code that wants one.

    Args:
        images: (N, C, H, W) uint8 pixels in [0, 255], or float images already
            normalised (synthetic data); stored as given.
        labels: (N,) int64 class indices.
        mean, std: normalisation of pixels scaled to [0, 1]: ``(x / 255 - mean) / std``.
            Ignored for float images.

    Attributes:
        tensors: ``(images, labels)`` as stored (uint8 for real data).

    Raises:
        ValueError: images and labels of different lengths.
    """

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, *, mean: float = 0.0, std: float = 1.0
    ) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        super().__init__(images, labels)
        self.mean, self.std = mean, std

    def normalise(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 pixels (B, C, H, W) -> normalised float32 on the same device; floats pass."""
        if images.dtype != torch.uint8:
            return images
        x = TF.to_dtype(images, torch.float32, scale=True)  # uint8 -> [0, 1]
        return TF.normalize(x, mean=[self.mean], std=[self.std])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = self.tensors
        return self.normalise(images[index : index + 1])[0], labels[index]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = self.tensors
        idx = torch.as_tensor(indices, device=images.device)
        return self.normalise(images[idx]), labels[idx]

    def to(self, device: torch.device | str) -> ImageTensorDataset:
        """The same dataset with its tensors on ``device`` (a no-op when already there)."""
        self.tensors = tuple(t.to(device) for t in self.tensors)
        return self


def _whole_batch(batch):
    # __getitems__ already returns the finished (images, labels) batch.
    return batch


class InMemoryDataModule(L.LightningDataModule):
    """Serves ``(image, label)`` batches from tensors that subclasses build in ``setup``.

    Subclasses set ``self.data_train``, ``self.data_val`` and ``self.data_test`` to
    :class:`ImageTensorDataset` s (or any map-style dataset of ``(image, label)`` pairs),
    and ``self.source`` to a short text saying where the data came from (written into
    ``metrics.json``).

    Args:
        batch_size: images per training batch.
        num_workers: DataLoader worker processes; 0 is right for in-memory tensors,
            where a worker only adds inter-process copies.
        pin_memory: pin host memory (helps host-to-GPU copies of a dataset that stays on
            the host).
        augment: arguments of :class:`~vit_mnist.data.augment.BatchAugment` (``degrees``,
            ``translate``, ``scale``, ``hflip``, ``erasing``) applied to training batches
            after they reach the device; None for no augmentation. Validation and test
            batches are never augmented.
        on_device: when the trainer runs on a GPU, move the tensors of every
            :class:`ImageTensorDataset` there once in ``setup`` (MNIST is 47 MB), so no
            batch crosses the PCIe bus. Ignored on the CPU and for other datasets.

    Batches: images float32 (B, C, H, W), normalised; labels int64 (B,).
    """

    name = "in-memory"
    num_classes = 10
    class_names: tuple[str, ...] = tuple(str(i) for i in range(10))
    image_shape = (1, 28, 28)

    # Normalised value of a black pixel, used to fill what augmentation brings in.
    background = 0.0

    def __init__(
        self,
        batch_size: int = 256,
        num_workers: int = 0,
        pin_memory: bool = False,
        augment: dict | None = None,
        on_device: bool = True,
    ):
        super().__init__()
        self.augment = BatchAugment(**augment, fill=self.background) if augment else None
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        self.on_device = on_device
        self.data_train: Dataset | None = None
        self.data_val: Dataset | None = None
        self.data_test: Dataset | None = None
        self.source: str | None = None

    @property
    def train_size(self) -> int | None:
        """Images in the training split, known before ``setup`` reads any data; None where
        a subclass cannot say."""
        return None

    def check_batch_size(self, size: int | None = None) -> None:
        """Refuse a batch larger than the training split.

        Raises:
            ConfigError: names ``data.batch_size`` and the largest that would do.
        """
        size = self.train_size if size is None else size
        if size is not None and self.batch_size > size:
            # The loader would serve one short batch, and metrics.json would record a batch
            # size that never ran.
            raise ConfigError(
                f"data.batch_size={self.batch_size} is larger than the {size} training "
                f"images of {self.name}; use data.batch_size={size} or less"
            )

    def move_to_device(self) -> None:
        """Move the tensor datasets to the trainer's GPU when ``on_device`` says so."""
        device = self.trainer.strategy.root_device if self.trainer is not None else None
        if not (self.on_device and device is not None and device.type == "cuda"):
            return
        for data in (self.data_train, self.data_val, self.data_test):
            if isinstance(data, ImageTensorDataset):
                data.to(device)
        log.info("dataset tensors moved to %s", device)

    def _loader(self, dataset: Dataset | None, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() has not been called")
        if shuffle:
            self.check_batch_size(len(dataset))
        batched = isinstance(dataset, ImageTensorDataset)
        on_gpu = batched and dataset.tensors[0].device.type == "cuda"
        # Worker processes cannot share CUDA tensors; pinning is for host memory only.
        workers = 0 if on_gpu else self.num_workers
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=workers,
            pin_memory=self.pin_memory and not on_gpu,
            persistent_workers=workers > 0,
            collate_fn=_whole_batch if batched else None,
        )

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        # A batch is (images, labels); Lightning's model summary sends the module's example
        # input (images alone, ViTClassifier.example_input_array) through this hook too.
        training = self.trainer is not None and self.trainer.training
        if self.augment is not None and training and isinstance(batch, (tuple, list)):
            return self.augment(batch[0]), batch[1]
        return batch

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.data_train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.data_val, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.data_test, shuffle=False)

    @staticmethod
    def split(n: int, val_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices (train, val) of a seeded random split of ``range(n)``."""
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        return perm[val_size:], perm[:val_size]
