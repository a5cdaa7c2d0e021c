"""Test-only pieces: callbacks that configs can name by ``_target_``, shared checks."""

from __future__ import annotations

import os
import sys

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


def record_compiles(monkeypatch, backend: str) -> list[dict]:
    """A list of the keyword arguments of each ``torch.compile`` call for as long as the
    test runs; the calls go through with them, on ``backend`` ("eager", "aot_eager":
    seconds where inductor's C++ takes a minute on 2 cores)."""
    import torch

    asked = []
    real_compile = torch.compile

    def compile_on_backend(fn, **kwargs):
        asked.append(kwargs)
        return real_compile(fn, backend=backend, **kwargs)

    monkeypatch.setattr(torch, "compile", compile_on_backend)
    return asked


def in_process(monkeypatch, capsys, *argv: str, task: str = "train") -> tuple[int, str, str]:
    """``vit_mnist.cli.<task>`` run in this process with ``argv``, as ``python <task>.py``
    runs it: (exit status, stdout, stderr). For what needs no process of its own: Hydra's
    composition errors, the tasks' checks of their settings, a sweep's exit status."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from vit_mnist import cli, errors

    # Which task has begun and which jobs failed are the process's state; each call here
    # is a process of its own.
    monkeypatch.setattr(cli, "_STARTED", [])
    monkeypatch.setattr(errors, "FAILED_JOBS", [])

    # Hydra's own logging config would add handlers on this test's captured stderr, left
    # behind for later tests: "none" keeps Hydra's hands off logging.
    quiet = ["hydra/hydra_logging=none", "hydra/job_logging=none"]
    monkeypatch.setattr(sys, "argv", [f"{task}.py", *argv, *quiet])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    code = 0
    try:
        getattr(cli, task)()
    except SystemExit as stop:
        code = stop.code
    finally:
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None  # the last job's, read by code that asks Hydra
    # Set for Hydra during the call only: the processes started later print one line too.
    assert "HYDRA_FULL_ERROR" not in os.environ
    out, err = capsys.readouterr()
    return code, out, err
