"""The parts of a training run: the LightningModule (``module``), its learning-rate schedule
and distillation loss, checkpoints (reading, resuming, writing atomically), the run's checks
before anything is built (``checks``), and the Lightning callbacks (``callbacks``)."""
