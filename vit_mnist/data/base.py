"""A LightningDataModule over in-memory tensors: the whole of MNIST is 47 MB as uint8."""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from vit_mnist.data.augment import BatchAugment


class InMemoryDataModule(L.LightningDataModule):
    """Serves ``(image, label)`` batches from tensors that subclasses build in ``setup``.

    Subclasses set ``self.data_train``, ``self.data_val`` and ``self.data_test`` to
    :class:`~torch.utils.data.TensorDataset` s of normalised float32 images
    (N, 1, 28, 28) and int64 labels (N,), and ``self.source`` to a short text saying
    where the data came from (written into ``metrics.json``).

    Args:
        batch_size: images per training batch.
        num_workers: DataLoader worker processes; 0 is right for in-memory tensors,
            where a worker only adds inter-process copies.
        pin_memory: pin host memory (helps host-to-GPU copies).
        augment: arguments of :class:`~vit_mnist.data.augment.BatchAugment` (``degrees``,
            ``translate``, ``scale``, ``hflip``, ``erasing``) applied to training batches
            after they reach the device; None for no augmentation. Validation and test
            batches are never augmented.
    """

    name = "in-memory"
    num_classes = 10
    class_names: tuple[str, ...] = tuple(str(i) for i in range(10))
    image_shape = (1, 28, 28)

    # Normalised value of a black pixel, used to fill what augmentation brings in.
    background = 0.0

    def __init__(
        self,
        *,
        batch_size: int = 256,
        num_workers: int = 0,
        pin_memory: bool = False,
        augment: dict | None = None,
    ):
        super().__init__()
        self.augment = BatchAugment(**augment, fill=self.background) if augment else None
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.data_train: TensorDataset | None = None
        self.data_val: TensorDataset | None = None
        self.data_test: TensorDataset | None = None
        self.source: str | None = None

    def _loader(self, dataset: TensorDataset | None, shuffle: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() has not been called")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
        )

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        if self.augment is not None and self.trainer is not None and self.trainer.training:
            x, y = batch
            batch = (self.augment(x), y)
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
