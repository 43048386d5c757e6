"""`covidxray serve` from outside, as a client on 127.0.0.1 sees it: its answers against `covidxray predict --json`
(the oracle) on the same files, its limits, its token and headers, and the faults a network brings. Every test
counts the statuses it saw; the server's whole output is checked for tracebacks when it stops.
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import struct
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import SHARED_DATA, run_cli
from serving import start_server, stop_server
from test_predict import held_out_images

pytest.importorskip("flask")
pytest.importorskip("waitress")

LIMIT_MB = 4  # a small upload limit, so the refusals are quick to provoke


def model_file(run_dir: Path) -> Path:
    return run_dir / "model-float32.tflite"


@pytest.fixture(scope="module")
def server(exported_run, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    running = start_server(model_file(exported_run), log, "--set", f"serve.max_upload_mb={LIMIT_MB}")
    yield running
    output = stop_server(running)
    assert "Traceback" not in output, output
    assert [s for s in running.statuses if s >= 500] == []


def without_file(entry: dict) -> dict:
    return {key: value for key, value in entry.items() if key != "file"}


def photo_files(folder: Path) -> dict[str, Path]:
    """A gray photo (the radiograph gate's to refuse) and a colour one (refused as a photo while decoding)."""
    from skimage import data

    folder.mkdir(exist_ok=True)
    cv2.imwrite(str(folder / "camera.png"), data.camera())
    cv2.imwrite(str(folder / "astronaut.jpg"), cv2.cvtColor(data.astronaut(), cv2.COLOR_RGB2BGR))
    (folder / "notes.txt").write_text("not an image")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    return {p.name: p for p in folder.iterdir()}


def real_files(root: Path) -> list[Path]:
    """A real PNG film and the real radiograph DICOM files of ../shared/data, when present."""
    pngs = sorted(root.glob("covid-chestxray-sample/**/*.png"))[:1]
    dicoms = sorted(p for p in (root / "dicom").glob("*") if p.is_file())
    return pngs + dicoms


def test_answers_equal_predict_json_for_the_same_files(server, exported_run, synthetic_data, tmp_path):
    files = [*held_out_images(synthetic_data, 4), *photo_files(tmp_path / "bad").values()]
    files += real_files(SHARED_DATA)[:4] if SHARED_DATA.is_dir() else []  # real films and DICOM, when present
    result = run_cli("predict", "--json", "--model", str(model_file(exported_run)), *map(str, files))
    expected = json.loads(result.stdout)
    assert len(expected) == len(files)
    kinds = set()
    for path, oracle in zip(files, expected):
        status, answer = server.post(path.read_bytes(), filename=path.name)
        assert answer["file"] == path.name
        assert without_file(answer) == without_file(oracle), path.name
        kinds.add("label" if "label" in answer else "rejected" if "rejected" in answer else answer["reason"])
        assert status == (200 if "label" in answer else 422), (path.name, answer)
    assert {"label", "rejected", "not-xray", "unreadable"} <= kinds  # each kind of answer was compared


def test_healthz_names_the_model_and_its_sidecar(server, exported_run):
    import hashlib

    status, health = server.request("GET", "healthz")
    card = json.loads(model_file(exported_run).with_suffix(".json").read_text())
    content = {key: value for key, value in card.items() if key != "tflite_sha256"}
    digest = hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert status == 200 and health["status"] == "ok"
    assert health["model"] == "model-float32.tflite" and health["sidecar_version"] == digest
    assert health["labels"] == card["labels"] and health["uptime_s"] >= 0
    assert "small_cnn" in health["overlay"]  # the phantom model has no class maps, and says why


def test_every_answer_carries_the_headers_that_stop_framing_and_injection(server):
    import urllib.request

    for path in ("", "app.js", "healthz", "nope"):
        try:
            response = urllib.request.urlopen(server.url + path, timeout=30)
        except urllib.error.HTTPError as err:
            response = err
        headers = response.headers
        assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]
        assert "script-src 'self'" in headers["Content-Security-Policy"]  # no inline script runs
        assert headers["X-Frame-Options"] == "DENY" and headers["X-Content-Type-Options"] == "nosniff"
    assert response.status == 404 and json.loads(response.read())["error"]


def png_declaring(width: int, height: int) -> bytes:
    """A tiny valid-looking PNG whose header declares width x height (a decompression bomb's header)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    rows = zlib.compress(b"\x00" * (width + 1) * 64)  # a few rows of zeros: compresses ~1000:1
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def test_a_decompression_bomb_is_refused_before_decoding(server):
    status, answer = server.post(png_declaring(30000, 30000), filename="bomb.png")
    assert status == 413 and answer["reason"] == "too-large" and "900,000,000" in answer["error"]


def test_a_path_in_the_file_name_is_shown_as_a_name_and_never_opened(server, synthetic_data, tmp_path):
    real = held_out_images(synthetic_data, 1)[0]  # a file the server could classify, if it opened the path
    status, answer = server.post(b"not an image", filename=str(real))
    assert status == 422 and answer["reason"] == "unreadable" and answer["file"] == real.name
    status, answer = server.post(
        real.read_bytes(), filename="..\\\\..\\\\windows\\\\x.png"
    )  # quoted-string escapes: the name has single backslashes
    assert status == 200 and answer["file"] == "x.png"


def test_requests_that_are_not_an_upload_get_a_clear_4xx(server):
    assert server.request("POST", "predict", b"a=b", {"Content-Type": "application/x-www-form-urlencoded"})[0] == 415
    status, answer = server.request("POST", "predict", b"", {"Content-Type": "multipart/form-data; boundary=x"})
    assert status == 400 and answer["error"]
    assert server.post(b"", filename="empty.png")[0] == 400
    assert server.request("GET", "predict")[0] == 405


def raw_request(url: str, head: str, body_bytes: int, chunk: bytes = b"\0" * 65536) -> tuple[bytes, int]:
    """Send `head`, then `chunk` after `chunk` (each whole) up to `body_bytes`, stopping when the server answers
    or closes; (the answer's first bytes, the body bytes sent)."""
    host, port = url.split("//")[1].rstrip("/").split(":")
    sent, pending = 0, b""
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode())
        sock.setblocking(False)
        while sent < body_bytes:
            try:
                answer = sock.recv(4096)
                if answer:
                    return answer, sent
            except BlockingIOError:
                pass
            pending = pending or chunk
            try:
                written = sock.send(pending)
            except BlockingIOError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            pending, sent = pending[written:], sent + written
        sock.setblocking(True)
        try:
            return sock.recv(4096), sent
        except ConnectionResetError:
            return b"", sent


def test_a_2gb_upload_is_refused_from_its_length_without_reading_it(server):
    head = "POST /predict HTTP/1.1\r\nHost: {}\r\nContent-Type: multipart/form-data; boundary=x\r\nContent-Length: {}\r\n\r\n"
    host = server.url.split("//")[1].rstrip("/")
    answer, sent = raw_request(server.url, head.format(host, 2 << 30), 2 << 30)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < 64 << 20  # refused long before 2 GB went over the wire
    chunked = f"POST /predict HTTP/1.1\r\nHost: {host}\r\nContent-Type: multipart/form-data; boundary=x\r\nTransfer-Encoding: chunked\r\n\r\n"
    block = b"10000\r\n" + b"\0" * 65536 + b"\r\n"  # endless 64 KiB chunks
    answer, sent = raw_request(server.url, chunked, 2 << 30, block)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < (LIMIT_MB + 16) << 20  # read only up to the limit
    server.statuses += [413, 413]


def test_a_client_that_disconnects_mid_upload_leaves_the_server_serving(server, synthetic_data):
    host = server.url.split("//")[1].rstrip("/")
    for _ in range(5):
        with socket.create_connection((host.split(":")[0], int(host.split(":")[1])), timeout=30) as sock:
            sock.sendall(
                f"POST /predict HTTP/1.1\r\nHost: {host}\r\nContent-Type: multipart/form-data; boundary=x\r\n"
                f"Content-Length: {3 << 20}\r\n\r\n".encode()
                + b"\0" * (1 << 20)
            )
    image = held_out_images(synthetic_data, 1)[0]
    assert server.post(image.read_bytes(), filename=image.name)[0] == 200


def test_a_full_queue_answers_503_at_once_and_the_rest_are_answered(exported_run, synthetic_data, tmp_path):
    running = start_server(
        model_file(exported_run), tmp_path / "serve.log", "--set", "serve.workers=1", "--set", "serve.queue=1"
    )
    image = held_out_images(synthetic_data, 1)[0].read_bytes()
    try:
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            statuses = sorted(s for s, _ in pool.map(lambda _: running.post(image, filename="x.png"), range(12)))
    finally:
        output = stop_server(running)
    assert "Traceback" not in output
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 2 and 503 in statuses


def test_a_token_is_needed_on_every_request_and_the_page_gets_it_as_a_cookie(exported_run, synthetic_data, tmp_path):
    import urllib.request

    token = "a-long-enough-test-token"
    running = start_server(model_file(exported_run), tmp_path / "serve.log", "--token", token)
    image = held_out_images(synthetic_data, 1)[0].read_bytes()
    try:
        assert running.request("GET", "healthz", headers={})[0] == 401
        assert running.request("GET", "healthz", headers={"Authorization": "Bearer wrong-token-wrong-token"})[0] == 401
        assert running.post(image, headers={"Authorization": "Bearer nope"})[0] == 401
        running.token = token
        assert running.request("GET", "healthz")[0] == 200
        assert running.post(image, filename="x.png")[0] == 200

        class NoRedirect(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *args, **kwargs):
                return None

        try:
            urllib.request.build_opener(NoRedirect).open(running.url + f"?token={token}", timeout=30)
            raise AssertionError("no redirect")
        except urllib.error.HTTPError as err:
            assert err.code == 303 and err.headers["Location"] == "/"
            cookie = err.headers["Set-Cookie"]
        assert token in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        page = urllib.request.Request(running.url, headers={"Cookie": cookie.split(";")[0]})
        assert b"Classify a chest X-ray" in urllib.request.urlopen(page, timeout=30).read()
    finally:
        output = stop_server(running)
    assert "Traceback" not in output


def test_an_address_beyond_loopback_gets_a_generated_token(exported_run, tmp_path):
    running = start_server(model_file(exported_run), tmp_path / "serve.log", "--host", "0.0.0.0")
    try:
        assert running.token and len(running.token) >= 16
        assert running.request("GET", "healthz", headers={})[0] == 401
        assert running.request("GET", "healthz")[0] == 200
    finally:
        stop_server(running)


def test_without_a_token_only_a_loopback_host_header_is_answered(server):
    assert server.request("GET", "healthz", headers={"Host": "attacker.example:80"})[0] == 403  # DNS rebinding


# Run before the CLI in the server's interpreter: once waitress serves (the model is loaded before, and its
# loader may use a temporary file for the runtime's banner), any temporary file (waitress' body spool, Werkzeug's
# multipart spool, anything the workers do) fails loudly.
NO_TEMP_FILES = """
import tempfile
serving = []
def _refusing(original):
    def refuse(*args, **kwargs):
        if serving:
            raise RuntimeError("a temporary file was opened")
        return original(*args, **kwargs)
    return refuse
for _name in ("TemporaryFile", "NamedTemporaryFile", "SpooledTemporaryFile", "mkstemp", "mkdtemp"):
    setattr(tempfile, _name, _refusing(getattr(tempfile, _name)))
import waitress.server
_run = waitress.server.BaseWSGIServer.run
def _serve(self):
    serving.append(True)
    return _run(self)
waitress.server.BaseWSGIServer.run = _serve
"""


def test_no_upload_touches_the_disk_unless_kept(exported_run, synthetic_data, tmp_path):
    image = held_out_images(synthetic_data, 1)[0]
    # 3 MB: above Werkzeug's 500 KB spool and waitress' 512 KB body buffer, each of which would write a file
    big = cv2.resize(cv2.imread(str(image), cv2.IMREAD_GRAYSCALE), (1800, 1800))
    big = np.clip(big + np.random.default_rng(0).normal(0, 12, big.shape), 0, 255).astype(np.uint8)
    data = cv2.imencode(".png", big)[1].tobytes()
    assert len(data) > 2 << 20
    running = start_server(model_file(exported_run), tmp_path / "serve.log", wrapper=NO_TEMP_FILES)
    try:
        status, answer = running.post(data, filename="big.png")
    finally:
        output = stop_server(running)
    assert status in (200, 422) and "error" not in answer, answer
    assert "Traceback" not in output and "temporary file" not in output
    kept = tmp_path / "kept"
    running = start_server(model_file(exported_run), tmp_path / "keep.log", "--keep", str(kept))
    try:
        running.post(image.read_bytes(), filename="../../x.png")
    finally:
        stop_server(running)
    [saved] = kept.iterdir()
    assert saved.read_bytes() == image.read_bytes() and saved.suffix == ".png" and "x" not in saved.stem[:8]


@pytest.mark.parametrize(
    "raw, shown",
    [
        ("/etc/passwd", "passwd"),
        ("C:\\Users\\me\\film.dcm", "film.dcm"),
        ("../../x.png", "x.png"),
        ("a\x00b\x1b[31m.png", "ab[31m.png"),
        ("", "upload"),
        ("..", "upload"),
        (None, "upload"),
        ("n" * 300, "n" * 200),
    ],
)
def test_the_client_file_name_becomes_a_display_name_only(raw, shown):
    from covidxray.serve.app import display_name

    assert display_name(raw) == shown


def test_which_addresses_need_a_token():
    from covidxray.errors import UserError
    from covidxray.serve.server import access_token, is_loopback

    assert all(map(is_loopback, ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "192.168.1.20", "pi.local", "localhost.example.com")))
    printed: list[str] = []
    assert access_token("127.0.0.1", None, printed.append) is None and printed == []
    made = access_token("0.0.0.0", None, printed.append)
    assert made and len(made) >= 32 and made in printed[0]
    with pytest.raises(UserError, match="16 characters"):
        access_token("0.0.0.0", "short", printed.append)


def test_serve_settings_out_of_range_are_named():
    from covidxray.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="serve.max_upload_mb"):
        load_config(None, [{"serve": {"max_upload_mb": 0}}])
    with pytest.raises(ConfigError, match="serve.queue"):
        load_config(None, [{"serve": {"queue": -1}}])


def test_the_pool_answers_at_its_time_limit_and_refuses_beyond_its_queue(monkeypatch):
    """One worker stuck on an upload: that client gets TooSlow at the limit, a queued one Busy once its wait is
    over, one more Busy at once; when the worker is free again, uploads are answered."""
    import threading
    import time
    from types import SimpleNamespace

    from covidxray.serve import workers

    release = threading.Event()

    def classify(predictor, upload, explain):
        release.wait(10)
        return {"file": upload.name, "label": "normal"}

    monkeypatch.setattr(workers, "classify_bytes", classify)
    pool = workers.InferencePool(SimpleNamespace(), workers=1, backlog=1, timeout_s=0.5)  # type: ignore[arg-type]
    outcomes: dict[str, tuple[str, float]] = {}

    def client(name: str) -> None:
        started = time.monotonic()
        try:
            outcome = pool.classify(workers.Upload(name, b"x"))["label"]
        except (workers.Busy, workers.TooSlow) as err:
            outcome = type(err).__name__
        outcomes[name] = (outcome, time.monotonic() - started)

    first = threading.Thread(target=client, args=("stuck",))
    first.start()
    time.sleep(0.1)  # the worker has it
    second = threading.Thread(target=client, args=("queued",))
    second.start()
    time.sleep(0.1)
    client("one-more")  # the queue (1) is full
    first.join()
    second.join()
    assert outcomes["stuck"][0] == "TooSlow" and 0.4 < outcomes["stuck"][1] < 2
    assert outcomes["one-more"][0] == "Busy" and outcomes["one-more"][1] < 0.2
    assert outcomes["queued"][0] == "Busy"  # not started within the wait for every job ahead of it
    release.set()
    time.sleep(0.2)
    assert pool.classify(workers.Upload("later", b"x"))["label"] == "normal"


def test_serve_without_its_web_packages_or_a_model_says_what_to_do(exported_run, tmp_path):
    import subprocess
    import sys

    code = "import sys; sys.modules['waitress'] = None; from covidxray.cli import main; main()"
    args = ["serve", "--model", str(model_file(exported_run))]
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "serve needs Flask and waitress" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    missing = run_cli("serve", "--model", str(tmp_path / "none.tflite"))
    assert missing.returncode == 2 and "not found" in missing.stderr and "Traceback" not in missing.stderr
