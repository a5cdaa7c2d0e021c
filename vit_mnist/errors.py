"""Errors that the command line reports as one line, without a traceback."""


class ConfigError(ValueError):
    """A setting that cannot work, such as ``embed_dim`` not divisible by ``num_heads``.

    The message names the key, the value and what would be valid.
    """


class DataError(RuntimeError):
    """A data file that is missing, truncated or fails its checksum, and cannot be rebuilt.

    The message names the file and says how to fix it.
    """


class CheckpointError(RuntimeError):
    """A checkpoint path that is missing, unreadable or not a checkpoint of this project."""


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the message names the step and the LR."""
