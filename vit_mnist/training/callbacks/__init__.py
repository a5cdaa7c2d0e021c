"""Lightning callbacks of this project; each is named in ``configs/callbacks/`` except
``trial_pruning.TrialPruning``, which the study sweeper adds to its trials' runs."""

from vit_mnist.training.callbacks.attention_maps import AttentionMapLogger
from vit_mnist.training.callbacks.save_on_interrupt import SaveOnInterrupt
from vit_mnist.training.callbacks.throughput import TrainThroughput

__all__ = ["AttentionMapLogger", "SaveOnInterrupt", "TrainThroughput"]
