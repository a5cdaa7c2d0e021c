"""Test-only pieces that configs can name by ``_target_``."""

from __future__ import annotations

import lightning as L


class PoisonBatch(L.Callback):
    """Turns the training batch at ``at_step`` into NaNs, to provoke a non-finite loss."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if trainer.global_step == self.at_step:
            batch[0].fill_(float("nan"))


def assert_same_values_and_gradients(fast, slow, inputs, *, atol: float, rtol: float) -> None:
    """``fast`` and ``slow`` (two computations of one quantity) agree, and so do the
    gradients of ``sum(out**2)`` with respect to every tensor in ``inputs``."""
    import torch

    torch.testing.assert_close(fast, slow, atol=atol, rtol=rtol)
    for a, b in zip(
        torch.autograd.grad(fast.square().sum(), inputs),
        torch.autograd.grad(slow.square().sum(), inputs),
        strict=True,
    ):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def count_applies(monkeypatch, function) -> list[int]:
    """A list that grows by one element at each ``function.apply`` call (an
    ``autograd.Function``), for as long as the test runs; the calls still go through."""
    calls = []
    apply = function.apply

    def counting(*args):
        calls.append(1)
        return apply(*args)

    monkeypatch.setattr(function, "apply", counting)
    return calls


class PauseInSetup(L.Callback):
    """Prints ``paused in setup`` and sleeps in the ``setup`` hook, which Lightning calls
    after the Trainer is built and before a resumed checkpoint is restored: the window in
    which an interrupt must not overwrite the checkpoint being resumed."""

    def __init__(self, seconds: float = 60.0) -> None:
        self.seconds = seconds

    def setup(self, trainer, pl_module, stage: str) -> None:
        import time

        print("paused in setup", flush=True)
        time.sleep(self.seconds)
