"""A fixed pool of inference threads behind a bounded queue: where `serve` classifies an upload.

Each worker owns one `Predictor` (a LiteRT interpreter is not thread-safe) and runs
`covidxray.edge.predict.predict_path` on the upload, exactly as `covidxray predict`
does on a file. The bytes reach that path as an anonymous in-memory file
(`memfd_create`, Linux): never a file on disk, never a path from the client. A
request that finds the queue full is refused at once (`Busy`), and one whose work
takes longer than the time limit gets an answer at the limit (`TooSlow`).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from queue import Full, Queue

from covidxray.edge.predict import Explainer, Predictor, predict_path
from covidxray.errors import UserError
from covidxray.files import atomic_write
from covidxray.records import IMAGE_SUFFIXES


class Busy(Exception):
    """Every worker is busy and the queue is full (or nothing was started within the wait)."""


class TooSlow(Exception):
    """The upload was not decoded and classified within the time limit."""


@dataclass
class Upload:
    name: str  # what the client called the file, reduced to a display name: shown, never opened
    data: bytes
    overlay: bool = False  # add the Grad-CAM overlay as a data: URL under "gradcam"


@dataclass
class _Job:
    upload: Upload
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    result: dict = field(default_factory=dict)


def in_memory_path(fd: int) -> Path:
    return Path(f"/proc/self/fd/{fd}")


def require_memory_files() -> None:
    if not hasattr(os, "memfd_create") or not Path("/proc/self/fd").is_dir():
        raise UserError("covidxray serve needs Linux (uploads are decoded from memory with memfd_create)")


def classify_bytes(predictor: Predictor, upload: Upload, explain: Explainer | None) -> dict:
    """predict's answer for the upload's bytes, under the upload's display name."""
    fd = os.memfd_create("covidxray-upload", os.MFD_CLOEXEC)
    try:
        with open(fd, "wb", closefd=False) as handle:
            handle.write(upload.data)
        path = in_memory_path(fd)
        result = predict_path(path, predictor.classifier, explain, predictor.max_pixels, predictor.profile)
    finally:
        os.close(fd)
    return _renamed(result, str(path), upload.name)


def _renamed(result: dict, path: str, name: str) -> dict:
    """The in-memory file's path replaced by the client's name (also inside an error's text)."""
    renamed = {**result, "file": name}
    if isinstance(renamed.get("error"), str):
        renamed["error"] = renamed["error"].replace(path, name)
    return renamed


def kept_name(upload: Upload) -> str:
    """A name of the server's own making for `--keep`: time and content hash, the suffix only when it is an image's."""
    suffix = Path(upload.name).suffix.lower()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"{stamp}-{hashlib.sha256(upload.data).hexdigest()[:16]}{suffix if suffix in IMAGE_SUFFIXES else ''}"


class InferencePool:
    """`workers` threads, each with its own twin of `predictor`, fed from a queue of at most `backlog` waiting uploads."""

    def __init__(
        self,
        predictor: Predictor,
        workers: int,
        backlog: int,
        timeout_s: float,
        explainer_for: Callable[[Predictor], Explainer | None] = lambda _predictor: None,
        keep_dir: Path | None = None,
        log: Callable[[str], None] = lambda _message: None,
    ):
        require_memory_files()
        self.timeout_s = timeout_s
        self.keep_dir = keep_dir
        self.log = log
        self.workers = workers
        self._queue: Queue[_Job] = Queue(maxsize=max(backlog, 1))
        self._lock = threading.Lock()
        predictors = [predictor, *(predictor.twin() for _ in range(workers - 1))]
        self.predictor = predictor
        self.overlay_available = explainer_for(self.predictor) is not None
        for number, predictor in enumerate(predictors):
            thread = threading.Thread(
                target=self._work, args=(predictor, explainer_for(predictor)), name=f"infer-{number}", daemon=True
            )
            thread.start()

    def classify(self, upload: Upload) -> dict:
        """predict's answer for `upload`; Busy or TooSlow when it cannot be given in time."""
        if self.keep_dir is not None:
            atomic_write(self.keep_dir / kept_name(upload), upload.data)
        job = _Job(upload)
        try:
            self._queue.put_nowait(job)
        except Full:
            raise Busy from None
        # Each job ahead of this one takes at most the time limit (else it is given up on): wait for them all.
        ahead = self._queue.maxsize + self.workers
        if not job.started.wait(self.timeout_s * ahead / self.workers):
            with self._lock:
                if not job.started.is_set():
                    job.cancelled = True
                    raise Busy
        if not job.done.wait(self.timeout_s):
            self.log(f"{upload.name}: not done within {self.timeout_s:g} s; its answer will be dropped")
            raise TooSlow
        return job.result

    def _work(self, predictor: Predictor, explain: Explainer | None) -> None:
        while True:
            job = self._queue.get()
            with self._lock:
                if job.cancelled:
                    continue
                job.started.set()
            try:
                job.result = classify_bytes(predictor, job.upload, explain if job.upload.overlay else None)
            except Exception as err:  # noqa: BLE001  a bug must not take the worker (and every later upload) down
                self.log(f"{job.upload.name}: {type(err).__name__}: {err}")
                job.result = {
                    "file": job.upload.name,
                    "error": f"cannot classify ({type(err).__name__})",
                    "reason": "internal",
                }
            job.done.set()
