"""Start `covidxray serve`: check the address and token, load the workers, run waitress with nothing spooled to disk.

waitress buffers a request body in memory up to `inbuf_overflow` bytes and in a
temporary file beyond it, and a response likewise beyond `outbuf_overflow`: both
are raised above the largest body and answer allowed, so no upload touches the
disk. `max_request_body_size` refuses a larger body from its Content-Length
(or, chunked, as soon as it passes the limit), before reading it.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from covidxray.config import Config
from covidxray.errors import UserError

TOKEN_ENV = "COVIDXRAY_SERVE_TOKEN"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
MAX_ANSWER_BYTES = 64 << 20  # a JSON answer with a 1024 px overlay is ~1-2 MB


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def access_token(host: str, given: str | None, say: Callable[[str], None]) -> str | None:
    """The token every request must carry: given, or made here for an address other than loopback; None on
    loopback without one."""
    if given is not None:
        if len(given) < 16:
            raise UserError("--token: give at least 16 characters (or leave it out and one is generated)")
        return given
    if is_loopback(host):
        return None
    token = secrets.token_urlsafe(24)
    say(f"access token (needed on every request; keep it private): {token}")
    return token


def serve(
    model_path: Path,
    config: Config,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    keep_dir: Path | None = None,
    say: Callable[[str], None] = print,
    warn: Callable[[str], None] = print,
) -> None:
    """Serve `model_path` until interrupted."""
    from waitress import create_server

    from covidxray.edge.class_maps import overlay_data_url
    from covidxray.edge.predict import Predictor
    from covidxray.serve.app import MULTIPART_SLACK, create_app
    from covidxray.serve.workers import InferencePool

    settings = config.serve
    token = access_token(host, token if token is not None else os.environ.get(TOKEN_ENV), say)
    if keep_dir is not None:
        try:
            keep_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(f"--keep {keep_dir}: cannot make the folder ({err.strerror or err})") from None
    workers = settings.workers or os.cpu_count() or 1
    max_upload = int(settings.max_upload_mb * 2**20)
    pool = InferencePool(
        Predictor(model_path, 1, None, warn, config.data.max_pixels),
        workers,
        settings.queue,
        settings.decode_timeout_s,
        lambda predictor: overlay_data_url(predictor.classifier),
        keep_dir,
        warn,
    )
    allowed: set[str] | None = None if token else set()  # filled once the port (0: any free one) is bound
    max_body = max_upload + MULTIPART_SLACK
    server = create_server(
        create_app(pool, model_path.name, max_upload, token, allowed, warn),
        host=host,
        port=port,
        threads=workers + settings.queue + 2,  # every queued upload waits in a thread; two more for the page
        max_request_body_size=max_body,
        inbuf_overflow=max_body + 1,
        outbuf_overflow=MAX_ANSWER_BYTES,
        clear_untrusted_proxy_headers=True,
        ident="covidxray",
    )
    listening = getattr(server, "effective_listen", None) or [(server.effective_host, server.effective_port)]
    bound_port = int(listening[0][1])
    if allowed is not None:
        allowed.update(f"{name}:{bound_port}" for name in (*LOOPBACK_NAMES, host))
    shown = f"[{host}]" if ":" in host else host
    if not pool.overlay_available:
        warn(f"{model_path.name}: no Grad-CAM overlay on the page: {model_path.name} gives no class maps")
    say(f"serving {model_path} with {workers} worker(s) on http://{shown}:{bound_port}/ (Ctrl-C stops)")
    if token:
        say(f"open http://{shown}:{bound_port}/?token={token}")
    server.run()
