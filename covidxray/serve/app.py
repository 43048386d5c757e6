"""The Flask application: the page, `POST /predict`, `GET /healthz`; the access token and the safety headers.

Every answer is JSON or the page's own fixed files; a bad request gets a 4xx
with one clear message, never a traceback. A token, when the server has one,
is checked on every request: as `Authorization: Bearer TOKEN`, or as the
cookie the page's first visit (`/?token=TOKEN`) sets. Without a token (loopback
only) the Host header must name the loopback address, so a web page the user
visits cannot reach the server through DNS rebinding.
"""

from __future__ import annotations

import hmac
import io
import re
import time
from collections.abc import Callable
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

from flask import Flask, Request, jsonify, redirect, request
from werkzeug.exceptions import HTTPException

from covidxray import __version__
from covidxray.edge.class_maps import NO_OVERLAY
from covidxray.serve import page
from covidxray.serve.workers import Busy, InferencePool, TooSlow, Upload

COOKIE = "covidxray_token"
FILE_FIELD = "file"
MULTIPART_SLACK = 64 * 1024  # bytes of multipart framing and headers allowed beyond the file's own limit
NAME_LIMIT = 200
NOT_A_DIAGNOSIS = (
    "Not a diagnosis: a research model's output, for a clinician to weigh with the patient, never instead of one."
)
# What a browser may do with these pages: its own script, style and the overlay's data: URL; no framing, no
# plugins, no form posted elsewhere.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cache-Control": "no-store",
}
# A status per kind of answer: a refusal by the gate and a file that cannot be read are the client's to fix.
STATUS_BY_REASON = {"too-large": 413, "unsupported": 415, "internal": 500}


class InMemoryRequest(Request):
    """Multipart files kept in memory: Werkzeug would spool a file above 500 KB to a temporary file on disk."""

    max_form_parts = 8

    def _get_file_stream(self, total_content_length, content_type, filename=None, content_length=None):
        return io.BytesIO()


def display_name(raw: str | None) -> str:
    """The client's file name as shown in the answer: its last component (either slash), printable, bounded.
    Only ever displayed: no path from the client is opened."""
    name = PureWindowsPath(PurePosixPath(raw or "").name).name
    name = re.sub(r"[\x00-\x1f\x7f]", "", name).strip()[:NAME_LIMIT]
    return name if name.strip(".") else "upload"


def status_of(result: dict) -> int:
    if "label" in result:
        return 200
    return STATUS_BY_REASON.get(result.get("reason", ""), 422)


def problem(status: int, message: str):
    response = jsonify({"error": message})
    response.status_code = status
    return response


def access_problem(token: str | None, allowed_hosts: set[str] | None):
    """None when the request may go on; else the answer refusing it (or, for `/?token=`, setting the cookie)."""
    if token is None:
        if allowed_hosts is not None and request.host.lower() not in allowed_hosts:
            return problem(403, f"this server answers on {', '.join(sorted(allowed_hosts))} only")
        return None
    given = request.cookies.get(COOKIE) or ""
    header = request.headers.get("Authorization", "")
    if header.startswith("Bearer "):
        given = header[len("Bearer ") :]
    query = request.args.get("token")
    if request.method == "GET" and request.path == "/" and query is not None:
        if not hmac.compare_digest(query.encode(), token.encode()):
            return problem(401, "wrong access token: use the address the server printed when it started")
        response = redirect("/", code=303)  # the token leaves the address bar and the history
        response.set_cookie(COOKIE, token, httponly=True, samesite="Strict")
        return response
    if not hmac.compare_digest(given.encode(), token.encode()):
        return problem(
            401,
            "missing or wrong access token: open the address the server printed, or send 'Authorization: Bearer TOKEN'",
        )
    return None


def predict_response(pool: InferencePool, max_upload_bytes: int, too_large: str):
    """POST /predict: the uploaded file's answer in predict's JSON schema, with a status telling its kind."""
    if request.content_length is None:
        return problem(411, "send the image as multipart/form-data with a Content-Length (curl -F file=@IMAGE)")
    if not request.mimetype.startswith("multipart/form-data"):
        return problem(415, "send the image as multipart/form-data, field 'file' (curl -F file=@IMAGE)")
    upload = request.files.get(FILE_FIELD)
    if upload is None:
        return problem(400, "no file in the form: send it in the field 'file' (curl -F file=@IMAGE)")
    data = upload.stream.read(max_upload_bytes + 1)
    if len(data) > max_upload_bytes:
        return problem(413, too_large)
    if not data:
        return problem(400, "the file is empty")
    want_overlay = request.args.get("overlay", "0") in ("1", "true", "yes")
    try:
        result: dict[str, Any] = pool.classify(Upload(display_name(upload.filename), data, want_overlay))
    except Busy:
        response = problem(503, "busy: every worker is classifying and the queue is full; try again shortly")
        response.headers["Retry-After"] = "2"
        return response
    except TooSlow:
        return problem(
            422, f"the image was not decoded and classified within {pool.timeout_s:g} s (serve.decode_timeout_s)"
        )
    if want_overlay and "label" in result and "gradcam" not in result:
        result["gradcam_unavailable"] = NO_OVERLAY
    response = jsonify(result)
    response.status_code = status_of(result)
    return response


def create_app(
    pool: InferencePool,
    model_name: str,
    max_upload_bytes: int,
    token: str | None,
    allowed_hosts: set[str] | None,
    log: Callable[[str], None] = print,
) -> Flask:
    """The app over `pool`; `token` None: no token (loopback), and then only `allowed_hosts` in Host."""
    app = Flask(__name__)
    app.request_class = InMemoryRequest
    app.json.sort_keys = False  # type: ignore[attr-defined]  # keys in predict's order (DefaultJSONProvider)
    app.config["MAX_CONTENT_LENGTH"] = max_upload_bytes + MULTIPART_SLACK
    too_large = f"upload too large: at most {max_upload_bytes / 2**20:g} MiB per image (serve.max_upload_mb)"
    guard(app, token, allowed_hosts, too_large, log)
    add_page(app)
    add_api(app, pool, model_name, max_upload_bytes, too_large)
    return app


def guard(app: Flask, token: str | None, allowed_hosts: set[str] | None, too_large: str, log: Callable[[str], None]):
    """On every request: the access check first, the safety headers last; every error as one JSON problem."""

    @app.before_request
    def check_access():
        return access_problem(token, allowed_hosts)

    @app.after_request
    def secure(response):
        response.headers.update(SECURITY_HEADERS)
        return response

    @app.errorhandler(HTTPException)
    def http_error(err: HTTPException):
        return problem(413, too_large) if err.code == 413 else problem(err.code or 400, err.description or err.name)

    @app.errorhandler(Exception)
    def internal_error(err: Exception):
        log(f"internal error: {type(err).__name__}: {err}")
        return problem(500, f"internal error ({type(err).__name__}); the server log has the details")


def add_page(app: Flask) -> None:
    """The page's own fixed files."""

    @app.get("/")
    def index():
        return page.INDEX, 200, {"Content-Type": "text/html; charset=utf-8"}

    @app.get("/app.js")
    def script():
        return page.SCRIPT, 200, {"Content-Type": "text/javascript; charset=utf-8"}

    @app.get("/app.css")
    def style():
        return page.STYLE, 200, {"Content-Type": "text/css; charset=utf-8"}

    @app.get("/favicon.ico")
    def favicon():
        return "", 204  # none; browsers ask for it anyway


def add_api(app: Flask, pool: InferencePool, model_name: str, max_upload_bytes: int, too_large: str) -> None:
    """GET /healthz (what is served, since when) and POST /predict."""
    started = time.monotonic()
    card = pool.predictor.classifier.card

    @app.get("/healthz")
    def healthz():
        return jsonify(
            {
                "status": "ok",
                "model": model_name,
                "sidecar_version": pool.predictor.classifier.sidecar_digest,
                "preprocessing": card.preprocessing,
                "labels": card.labels,
                "overlay": True if pool.overlay_available else NO_OVERLAY,
                "covidxray": __version__,
                "uptime_s": round(time.monotonic() - started, 1),
                "workers": pool.workers,
                "notice": NOT_A_DIAGNOSIS,
            }
        )

    @app.post("/predict")
    def predict():
        return predict_response(pool, max_upload_bytes, too_large)
