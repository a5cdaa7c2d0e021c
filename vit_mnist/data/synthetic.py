"""Synthetic digit-shaped data for fast tests: no files, no network."""

from __future__ import annotations

import torch

from vit_mnist.data.base import ImageTensorDataset, InMemoryDataModule


class SyntheticDataModule(InMemoryDataModule):
    """Random 1 x 28 x 28 images whose class is learnable.

    Each class has a fixed random prototype image; a sample is its class prototype
    plus Gaussian noise, so a model can fit it but must look at the pixels.

    Args:
        num_train, num_val, num_test: images per split.
        noise: standard deviation of the noise added to the unit-variance prototypes.
        seed: seed of the prototypes, labels and noise (same data for the same seed).
        batch_size, num_workers, pin_memory: as for the DataLoader.
        on_device: keep the tensors on the GPU when training there.
        augment: batch augmentation as for MNIST (None: off), so that an experiment's
            ``data.augment`` also applies to synthetic data in tests.

    Batches: images float32 (B, 1, 28, 28); labels int64 (B,) in 0..9.
    """

    name = "synthetic"

    def __init__(
        self,
        *,
        num_train: int = 512,
        num_val: int = 128,
        num_test: int = 128,
        noise: float = 1.0,
        seed: int = 0,
        batch_size: int = 64,
        num_workers: int = 0,
        pin_memory: bool = False,
        on_device: bool = True,
        augment: dict | None = None,
    ) -> None:
        super().__init__(batch_size, num_workers, pin_memory, augment, on_device)
        self.sizes = (num_train, num_val, num_test)
        self.noise, self.seed = noise, seed

    def prepare_data(self) -> None:
        self.source = "synthetic"

    @property
    def train_size(self) -> int:
        return self.sizes[0]

    def setup(self, stage: str | None = None) -> None:
        if self.data_train is not None:
            self.move_to_device()
            return
        self.source = "synthetic"
        g = torch.Generator().manual_seed(self.seed)
        prototypes = torch.randn(self.num_classes, *self.image_shape, generator=g)
        splits = []
        for n in self.sizes:
            y = torch.randint(0, self.num_classes, (n,), generator=g)
            x = prototypes[y] + self.noise * torch.randn(n, *self.image_shape, generator=g)
            splits.append(ImageTensorDataset(x, y))
        self.data_train, self.data_val, self.data_test = splits
        self.move_to_device()
