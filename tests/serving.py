"""`covidxray serve` started as a user starts it (the console script, a free port), for the serve tests and bench."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

VENV_BIN = Path(sys.executable).parent
URL_LINE = re.compile(r"on (http://\S+/) \(Ctrl-C stops\)")


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    log_path: Path
    token: str | None = None
    statuses: list[int] = field(default_factory=list)  # every status the tests saw, to count 5xx

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, data: bytes, filename: str = "image.png", query: str = "", headers: dict | None = None):
        """(status, JSON answer) of POST /predict with `data` as the multipart field `file`."""
        boundary = uuid.uuid4().hex
        body = (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
                "Content-Type: application/octet-stream\r\n\r\n"
            ).encode()
            + data
            + f"\r\n--{boundary}--\r\n".encode()
        )
        all_headers = {"Content-Type": f"multipart/form-data; boundary={boundary}", **self.auth(), **(headers or {})}
        return self.request("POST", "predict" + query, body, all_headers)

    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        request = urllib.request.Request(
            self.url + path, data=body, method=method, headers=self.auth() if headers is None else headers
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                status, text = response.status, response.read()
        except urllib.error.HTTPError as err:
            status, text = err.code, err.read()
        self.statuses.append(status)
        return status, json.loads(text)


def start_server(model: Path, log_path: Path, *args: str, env: dict | None = None, wrapper: str = "") -> Server:
    """`covidxray serve --model MODEL --port 0 ARGS`; returns once it answers /healthz.

    `wrapper`: Python run before the CLI in the server's own interpreter (e.g. to make temporary files fail).
    """
    command = (
        [sys.executable, "-c", wrapper + "\nfrom covidxray.cli import main\nmain()"]
        if wrapper
        else [str(VENV_BIN / "covidxray")]
    )
    handle = open(log_path, "w")
    process = subprocess.Popen(
        [*command, "serve", "--model", str(model), "--port", "0", *args],
        stdout=handle,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        match = URL_LINE.search(log_path.read_text())
        if match:
            server = Server(process, match.group(1), log_path)
            token = re.search(r"access token \(needed on every request; keep it private\): (\S+)", log_path.read_text())
            server.token = token.group(1) if token else None
            return server
        if process.poll() is not None:
            raise AssertionError(f"serve exited with {process.returncode}:\n{log_path.read_text()}")
        time.sleep(0.2)
    process.kill()
    raise AssertionError(f"serve did not start within 120 s:\n{log_path.read_text()}")


def stop_server(server: Server) -> str:
    """Stop it as Ctrl-C does; its whole output."""
    server.process.send_signal(2)
    try:
        server.process.wait(30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
    return server.log()
