"""Lightning callbacks of this project."""

from vit_mnist.callbacks.attention_maps import AttentionMapLogger

__all__ = ["AttentionMapLogger"]
