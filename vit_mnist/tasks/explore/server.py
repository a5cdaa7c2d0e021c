"""The explorer's launch: the address checked before Gradio binds it, the page started
(again, when a busy machine answers its first request late), the warning for a page open to
the network, and ``main``, the body of ``python scripts/explore.py``."""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from pathlib import Path
from urllib.parse import urlsplit

import torch
from omegaconf import DictConfig, OmegaConf

from vit_mnist.errors import CheckpointError, ConfigError, exit_on_user_error
from vit_mnist.settings import ExploreSettings, check_settings
from vit_mnist.tasks.explore.page import PAGE_CSS, build_page, import_gradio
from vit_mnist.tasks.explore.session import load_explorer

log = logging.getLogger(__name__)

LAUNCH_TRIES = 3


def check_address(server_name: str, server_port: int | None) -> bool:
    """Whether the page can be served at ``server_name`` and ``server_port`` (None: any
    free port), tried by binding a socket there before Gradio does; returns whether the
    address is a loopback one (reachable from this machine only).

    Raises:
        ConfigError: a name that does not resolve, an address that is not this machine's,
            or a port that another program holds; the message names the value and the fix.
    """
    loopback = "server_name=127.0.0.1 (this machine only) or 0.0.0.0 (every network)"
    if ":" in server_name:  # Gradio writes its own address without the brackets IPv6 needs
        raise ConfigError(f"server_name={server_name}: an IPv6 address; use {loopback}")
    try:
        family, kind, _, _, address = socket.getaddrinfo(
            server_name, server_port or 0, type=socket.SOCK_STREAM
        )[0]
    except (socket.gaierror, UnicodeError):
        raise ConfigError(f"server_name={server_name} does not resolve; use {loopback}") from None
    with socket.socket(family, kind) as probe:
        # As uvicorn binds: a port left in TIME_WAIT by a page just closed is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"server_port={server_port} is taken by another program; choose another "
                    "(server_port=7861) or leave it out for the first free port from 7860"
                ) from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(
                    f"server_name={server_name} ({address[0]}) is not an address of this "
                    f"machine; use {loopback}"
                ) from None
            raise ConfigError(
                f"cannot serve on server_name={server_name} server_port={server_port}: "
                f"{e.strerror}; use {loopback} and a port from 1024 up"
            ) from None
    return ipaddress.ip_address(address[0].split("%")[0]).is_loopback


def launch(
    page,
    *,
    server_name: str = "127.0.0.1",
    server_port: int | None = None,
    max_upload_mb: float = 10.0,
) -> str:
    """Start ``page`` in a background thread; returns its address (``http://host:port/``).

    Telemetry off, Gradio's footer links (API, settings) off, uploads over
    ``max_upload_mb`` refused, nothing served beyond Gradio's own cache of the pictures
    (``allowed_paths`` stays empty).
    """
    gr = import_gradio()
    # System fonts only: Gradio's default theme asks Google Fonts, which an offline machine
    # cannot reach (the page then waits on it).
    theme = gr.themes.Default(
        font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"]
    )
    for attempt in range(LAUNCH_TRIES):
        try:
            _, url, _ = page.launch(
                server_name=server_name,
                server_port=server_port,
                prevent_thread_lock=True,
                quiet=True,
                share=False,
                max_file_size=int(max_upload_mb * 1024 * 1024),  # bytes
                footer_links=[],
                ssr_mode=False,
                mcp_server=False,
                theme=theme,
                css=PAGE_CSS,
            )
            return url
        except ValueError as e:
            # Gradio asks its own new server for the page once, with a 3 s timeout, and
            # gives up when a busy machine answers later: the server is closed and started
            # again.
            if "localhost is not accessible" not in str(e) or attempt == LAUNCH_TRIES - 1:
                raise
            log.warning("the page did not answer in time; starting it again")
            page.close()


@exit_on_user_error
def main(cfg: DictConfig) -> None:
    """The body of ``python scripts/explore.py ckpt_path=PATH``: start the page, print its
    address, serve until Ctrl-C.

    Raises:
        CheckpointError: no or an unreadable checkpoint (exit status 2).
        ConfigError: a bad setting, an unreadable ``heads_csv``, no Gradio, an address
            the page cannot be served at (exit status 2).
    """
    if OmegaConf.is_missing(cfg, "ckpt_path"):
        raise CheckpointError("ckpt_path is required: scripts/explore.py ckpt_path=PATH")
    check_settings(cfg, ExploreSettings)
    loopback = check_address(cfg.server_name, cfg.server_port)
    # One image at a time: a second thread only waits on the first, and on a shared
    # machine it competes with everything else for the cores.
    torch.set_num_threads(1)
    explorer = load_explorer(cfg)
    explorer.run_dir = Path(cfg.paths.output_dir)
    page = build_page(explorer)
    # Gradio's requests to its own server are logged by httpx at INFO: not the user's news.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    url = launch(
        page,
        server_name=cfg.server_name,
        server_port=cfg.server_port,
        max_upload_mb=float(cfg.max_upload_mb),
    )
    print(f"explorer: {url} (Ctrl-C stops it)", flush=True)
    if not loopback:
        log.warning(
            "server_name=%s: the page is open to every machine that can reach this one on "
            "port %s, without a password; server_name=127.0.0.1 keeps it to this machine",
            cfg.server_name,
            urlsplit(url).port,
        )
    try:
        page.block_thread()
    finally:
        page.close()
