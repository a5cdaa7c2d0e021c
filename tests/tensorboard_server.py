"""Run TensorBoard's own server on a run dir and read it as a user's browser does.

Used by the slow test that checks the attention maps and metrics through TensorBoard's
HTTP API, and by ``scripts/tensorboard_screenshot.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_URL = re.compile(r"TensorBoard \S+ at (http://127\.0\.0\.1:\d+/)")


@contextmanager
def serve(logdir: str | Path, timeout_s: float = 120.0) -> Iterator[str]:
    """Start ``tensorboard --logdir LOGDIR`` on 127.0.0.1 and a free port; yield its URL.

    Loopback only: nothing outside this machine can reach it. The server is stopped when
    the ``with`` block ends.

    Raises:
        FileNotFoundError: ``logdir`` does not exist.
        RuntimeError: the server did not print its address within ``timeout_s`` seconds
            (its output is in the message).
    """
    if not Path(logdir).is_dir():
        raise FileNotFoundError(f"logdir {logdir} does not exist: pass a run dir of train.py")
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir)]
            + ["--host", "127.0.0.1", "--port", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                out.seek(0)
                if match := _URL.search(text := out.read()):
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"TensorBoard did not start:\n{text}")
                time.sleep(0.2)
            yield match.group(1)
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def get_json(url: str, path: str, **params: str) -> Any:
    """GET ``url + path`` with query ``params`` and parse the JSON answer."""
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    return json.loads(get_bytes(url, path + query))


def wait_for_tags(url: str, plugin: str, wanted: set[str], timeout_s: float = 120.0) -> dict:
    """Poll ``/data/plugin/<plugin>/tags`` until every tag in ``wanted`` is listed.

    TensorBoard reads event files in the background after it starts serving, so the first
    answers can be incomplete.

    Returns:
        ``{run: {tag: info}}`` as TensorBoard answers, once complete or after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        tags = get_json(url, f"/data/plugin/{plugin}/tags")
        seen = {tag for run_tags in tags.values() for tag in run_tags}
        if wanted <= seen or time.monotonic() > deadline:
            return tags
        time.sleep(0.5)


def get_bytes(url: str, path: str) -> bytes:
    """GET ``url + path`` (``path`` may carry its own query) and return the body."""
    with urllib.request.urlopen(url.rstrip("/") + path, timeout=60) as response:
        return response.read()
