"""LightningDataModules and the offline sources of their files."""

from vit_mnist.data.mnist import FashionMNISTDataModule, MNISTDataModule
from vit_mnist.data.synthetic import SyntheticDataModule

__all__ = ["FashionMNISTDataModule", "MNISTDataModule", "SyntheticDataModule"]
