"""Lightning callbacks of this project."""

from vit_mnist.callbacks.attention_maps import AttentionMapLogger
from vit_mnist.callbacks.throughput import TrainThroughput

__all__ = ["AttentionMapLogger", "TrainThroughput"]
