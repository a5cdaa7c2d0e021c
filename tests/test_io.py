"""File writing: whole files or none, with the permissions the umask asks for."""

from __future__ import annotations

import os
import stat

import pytest

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
    with pytest.raises(OSError, match="No space"):
        atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]
