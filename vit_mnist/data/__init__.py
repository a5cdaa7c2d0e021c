"""LightningDataModules and the offline sources of their files."""

from vit_mnist.data.mnist import MNISTDataModule
from vit_mnist.data.synthetic import SyntheticDataModule

__all__ = ["MNISTDataModule", "SyntheticDataModule"]
