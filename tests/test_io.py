"""File writing: whole files or none, with the permissions the umask asks for."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from vit_mnist.errors import WriteError
from vit_mnist.io import atomic_write_bytes


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_follow_the_umask(tmp_path, umask, mode):
    # mkstemp's 0600 would lock other users out of a shared data dir or checkpoint.
    old = os.umask(umask)
    try:
        atomic_write_bytes(tmp_path / "f.bin", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f.bin").stat().st_mode) == mode


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "metrics.json"
    atomic_write_bytes(target, b"old")

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(WriteError) as error:
        atomic_write_bytes(target, b"new")
    # One line that names the file, for a full disk as for any other write failure.
    assert str(error.value) == (
        f"cannot write {target}: No space left on device; the previous file is kept"
    )
    assert isinstance(error.value, OSError) and error.value.errno == 28
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


def test_a_checkpoint_that_cannot_be_written_names_it_and_how_to_resume(
    tmp_path, monkeypatch, capsys
):
    from vit_mnist.errors import exit_on_user_error
    from vit_mnist.training.checkpointing import AtomicCheckpointIO

    last = tmp_path / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"step": 1}, last)

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)

    @exit_on_user_error
    def save():
        AtomicCheckpointIO().save_checkpoint({"step": 2}, last)

    with pytest.raises(SystemExit) as exit_info:
        save()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {last}: No space left on device")
    assert "Make room, then resume: " in err and f"ckpt_path={last}" in err
    assert err.count("\n") == 1  # one line, no traceback
    assert torch.load(last, weights_only=True) == {"step": 1}
