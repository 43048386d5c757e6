"""Decode every image once: resized PNG + dedup hashes, cached on disk.

Decoding dominates `prepare`. Dedup must run before the patient split and
the split before shards are planned, so a naive pipeline decodes twice
(once to hash, once to shard). Instead one parallel pass turns each file
into everything later stages need: the resized PNG that goes into the shard,
the exact pixel digest, the perceptual hash and the local features of the
geometric near-duplicate check. These live in one SQLite file
under `<data_dir>/cache/`, keyed by the sha256 of the file's bytes, so a
re-run or a resumed run decodes only new or changed files (a file replaced in
place with the same size and mtime is still seen as changed, and a file name
that is not valid UTF-8 is never a key), and shards are written from the cache
without decoding again. The file name carries the image size and a fingerprint
of the preprocessing, hash and table definitions, so a change to any starts a
fresh cache; a damaged cache is set aside and rebuilt; deleting `cache/` is
always safe (it costs one decode).

Decode workers are separate processes; one killed from outside (the
out-of-memory killer on a 4 GB board) breaks the pool. The files it may have
been decoding are then retried one at a time, each alone in a fresh worker, so
a file that kills its worker twice is named and dropped instead of hanging or
ending the run. A decode running longer than data.decode_timeout_s (a crafted
file can send a decoder into an endless loop) has its worker killed the same
way: the file is named, retried once alone, then dropped as decode-timeout,
and the files the stopped pool held are queued again.

Workers never outlive prepare: on Linux the kernel kills each one when
prepare's process ends, however it ends (kill -9 included), and an
interrupt or error in prepare stops the pool without waiting for a decode
in progress. A pool is always stopped whole (every worker killed and the
result pipe closed on our side), because a worker killed while it sends a
result leaves half a message that would keep the executor's reader, and so
prepare's exit, waiting for good.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from covidxray.data import dedup, near_duplicates
from covidxray.edge import harmonise as harmonise_method
from covidxray.edge import preprocess, radiograph_gate
from covidxray.edge.image_header import DEFAULT_MAX_PIXELS
from covidxray.errors import UserError, reraise_interrupt
from covidxray.files import sha256_file
from covidxray.manifest import CACHE_DIR

if TYPE_CHECKING:
    from multiprocessing.queues import SimpleQueue

    from covidxray.config import DataConfig

_SCHEMA_VERSION = 3  # 3: + near-duplicate features; 2: keyed by content sha256 (1 was path, size, mtime)
_SCHEMA = """CREATE TABLE IF NOT EXISTS images (
    content_sha256 BLOB PRIMARY KEY, png BLOB, pixel_sha256 BLOB, phash BLOB, features BLOB, reason TEXT, detail TEXT)"""
_COMMIT_EVERY = 64
_IN_FLIGHT_PER_WORKER = 2  # enough to keep every worker busy; also bounds the files suspected when one dies
WORKER_DIED = "worker-died"  # the reason of a file that killed its decode worker twice
DECODE_TIMEOUT = "decode-timeout"  # the reason of a file dropped for decoding longer than data.decode_timeout_s twice
# Outcomes that depend on this run's limits and machine (data.max_pixels, data.decode_timeout_s, free memory),
# not on the file alone: never cached, so raising a limit or lowering data.workers takes effect on the next run.
_NOT_CACHED = frozenset({DECODE_TIMEOUT, WORKER_DIED, "too-large"})
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): the signal this process gets when its parent ends
_LIVENESS_CHECK_S = 1.0  # how often the pool's workers are checked for one that died
Job = tuple[str, int, int]  # (path, image size, max pixels)
Log = Callable[[str], None]


@dataclass(frozen=True)
class Decoded:
    """The outcome for one file: its hashes, or the countable reason it is unusable (detail: what, without the path)."""

    pixel_sha256: bytes = b""
    phash: bytes = b""
    features: bytes = (
        b""  # near_duplicates.features(): what the geometric duplicate check needs, without decoding again
    )
    reason: str = ""
    detail: str = ""

    @property
    def ok(self) -> bool:
        return not self.reason


def cache_path(data_dir: Path, image_size: int, harmonise: str = harmonise_method.NONE) -> Path:
    versions = [preprocess.PREPROCESSING_VERSION, dedup.HASH_VERSION, radiograph_gate.GATE_VERSION, _SCHEMA_VERSION]
    # the stored PNGs are harmonised; a cache of unharmonised pixels keeps its name
    definition = json.dumps(versions + ([harmonise] if harmonise != harmonise_method.NONE else []), sort_keys=True)
    tag = hashlib.sha256(definition.encode()).hexdigest()[:12]
    return Path(data_dir) / CACHE_DIR / f"decoded-{image_size}px-{tag}.sqlite"


def workers_of(config: DataConfig) -> int:
    """data.workers, 0 meaning one per core."""
    return config.workers or os.cpu_count() or 1


def keep_freed_buffers() -> bool:
    """Let this process reuse freed image buffers instead of handing them back to the kernel.

    A decoded radiograph (1 MB at 1024 px, tens of MB for a large 16-bit DICOM)
    is above glibc's default mmap threshold, so every decode maps, page-faults
    and unmaps fresh memory; reusing it decodes ~15% faster (scripts/bench_prepare.py).
    Memory already freed is kept up to 64 MB. False where libc has no mallopt (not glibc).
    """
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # libc is already loaded: no library search (a subprocess)
    return bool(mallopt and mallopt(_M_MMAP_THRESHOLD, 32 << 20) and mallopt(_M_TRIM_THRESHOLD, 64 << 20))


def decode_one(job: Job, harmonise: str = harmonise_method.NONE) -> tuple[str, bytes | None, Decoded]:
    """Worker: one file -> (path, resized PNG or None, Decoded). Never raises: one bad file must not end a run.

    `harmonise` (data.harmonise) changes the PNG's pixels only: the dedup signatures are of the film as decoded.
    """
    path, size, max_pixels = job
    try:
        gray = preprocess.load_gray(path, max_pixels)
        radiograph_gate.require_radiograph(gray, path)
        small = preprocess.resize_square(gray, size)
        thumb_source = small if size >= dedup.PHASH_INPUT else gray
        signatures = Decoded(
            dedup.pixel_digest(gray), dedup.perceptual_hash(thumb_source), near_duplicates.features(gray)
        )
        pixels = small if harmonise == harmonise_method.NONE else preprocess.model_pixels(gray, size, harmonise)
        return path, preprocess.encode_png(pixels), signatures
    except preprocess.ImageError as err:
        return path, None, Decoded(reason=err.reason, detail=err.detail)
    except Exception as err:  # decoder bugs on hostile files (cv2.error, MemoryError, ...) are that file's problem
        reraise_interrupt(err)
        return path, None, Decoded(reason="unreadable", detail=f"cannot decode ({err.__class__.__name__}: {err})")


def content_digest(path: str) -> bytes:
    """sha256 of the file's bytes: the cache key, so a file rewritten in place is never mistaken for its old self."""
    return bytes.fromhex(sha256_file(path))


def _content_or_none(path: str) -> bytes | None:
    try:
        return content_digest(path)
    except OSError:
        return None


def _worker_died() -> Decoded:
    return Decoded(
        reason=WORKER_DIED,
        detail=(
            "the decode worker was killed twice while decoding this file (e.g. by the out-of-memory killer); "
            "skipped. Lower data.max_pixels or data.workers if it is a valid radiograph"
        ),
    )


def _timed_out(timeout_s: float) -> Decoded:
    return Decoded(
        reason=DECODE_TIMEOUT,
        detail=(
            f"decoding took longer than data.decode_timeout_s ({timeout_s:g} s) twice, the second time alone in a "
            "fresh worker (a decoder stuck on a crafted file?); skipped. Raise data.decode_timeout_s if it is a "
            "valid radiograph on a slow board"
        ),
    )


_start_reports: (
    SimpleQueue  # set in each decode worker by _start_worker: where it reports each job it starts (see _PoolRun)
)


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this worker when prepare's process ends (Linux; a no-op where libc has no prctl)."""
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it ended before the death signal was set
        os._exit(1)


def _start_worker(start_reports, parent_pid: int) -> None:
    global _start_reports
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is prepare's to handle: it stops the whole pool
    _start_reports = start_reports
    keep_freed_buffers()


def _decode_reporting_start(decode: Callable, index: int, job: Job) -> tuple[str, bytes | None, Decoded]:
    # A few bytes, written at once (SimpleQueue has no feeder thread), so the report is out before a decoder
    # that holds the GIL can hang, and a worker killed later never leaves half a message in the pipe.
    _start_reports.put((index, os.getpid(), time.monotonic()))  # CLOCK_MONOTONIC: one clock for every process
    return decode(job)


@dataclass
class _PoolEnd:
    """How one pool's run ended: every job done, or the jobs that still need an answer."""

    timed_out: list[Job] = field(default_factory=list)  # their decode passed the limit; their worker was killed
    in_doubt: list[Job] = field(default_factory=list)  # in flight when a worker died by itself
    requeue: list[Job] = field(default_factory=list)  # not started, or innocent bystanders of a stopped pool


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """Stop `pool` at once, without waiting for anything: kill every worker, and close our end of the result pipe
    so that the executor's manager thread, even one reading half a message from a killed worker, sees its end.

    (ProcessPoolExecutor only gained kill_workers() in Python 3.14; this is it, plus the pipe.)
    """
    processes = list((pool._processes or {}).values())
    results = pool._result_queue
    pool.shutdown(wait=False)  # no cancel_futures: every future then ends with BrokenProcessPool, none Cancelled
    for process in processes:
        process.kill()
    if results is not None:
        results._writer.close()  # type: ignore[attr-defined]  # the executor's private pipe end; no public way to close it


class _PoolRun:
    """Feed jobs to a pool of spawned workers, passing each result to `take`, with an optional per-file time limit.

    The limit counts from when a worker starts the file, which the worker reports, not from submission:
    each worker holds _IN_FLIGHT_PER_WORKER jobs so it never waits for the next one, and a file queued
    behind a slow one must not be blamed for it. (Keeping only `workers` jobs in flight would make
    submission time nearly start time, but it would idle every worker between files and still count
    a worker's start-up, seconds on a loaded board, against its first file.)
    A ProcessPoolExecutor cannot cancel a running call, so a file over the limit stops the pool (a worker that
    dies by itself does too); the files its other workers held are queued again.
    """

    def __init__(self, workers: int, decode: Callable, take: Callable, timeout_s: float):
        self.workers, self.decode, self.take, self.timeout_s = workers, decode, take, timeout_s
        self.context = multiprocessing.get_context("spawn")
        self.in_flight: dict = {}  # future -> (index, job)
        self.started: dict[int, tuple[int, float]] = {}  # index -> (worker pid, monotonic start)
        self.stopped: set[int] = set()  # indices whose decode passed the limit (their pool was stopped for them)
        self.stopping = False

    def run(self, jobs: list[Job]) -> _PoolEnd:
        pending = deque(enumerate(jobs))
        start_reports = self.context.SimpleQueue()
        pool = ProcessPoolExecutor(
            self.workers, mp_context=self.context, initializer=_start_worker, initargs=(start_reports, os.getpid())
        )
        try:
            end = self._feed(pool, pending, start_reports)
        except BrokenProcessPool:
            end = self._after_break([job for _, job in pending])
        except BaseException:  # Ctrl-C, a full disk in `take`: never wait for a decode, nor for a stuck pool
            stop_pool(pool)
            raise
        finally:
            start_reports.close()
        pool.shutdown(wait=True)  # its workers are idle or gone: this returns at once
        return end

    def _feed(self, pool: ProcessPoolExecutor, pending: deque, start_reports) -> _PoolEnd:
        while True:
            while not self.stopping and pending and len(self.in_flight) < self.workers * _IN_FLIGHT_PER_WORKER:
                index, job = pending[0]
                self.in_flight[pool.submit(_decode_reporting_start, self.decode, index, job)] = (index, job)
                pending.popleft()
            if not self.in_flight:
                return _PoolEnd(requeue=[job for _, job in pending])
            done, _ = wait(self.in_flight, timeout=self._until_next_check(), return_when=FIRST_COMPLETED)
            for future in done:
                self.take(future.result())  # raises BrokenProcessPool once the pool was stopped
                del self.in_flight[future]
            self._read_start_reports(start_reports)  # also without a limit: unread, they would fill the pipe
            if not self.stopping and (self._overdue() or self._a_worker_died(pool)):
                self.stopping = True
                stop_pool(pool)

    def _read_start_reports(self, start_reports) -> None:
        while not start_reports.empty():
            index, pid, started = start_reports.get()
            self.started[index] = (pid, started)

    def _until_next_check(self) -> float:
        """Seconds to wait for a result before looking for a dead worker or a file over the limit."""
        if not self.timeout_s:
            return _LIVENESS_CHECK_S
        now = time.monotonic()
        running = [
            self.started[i][1] for i, _ in self.in_flight.values() if i in self.started and i not in self.stopped
        ]
        return min(
            _LIVENESS_CHECK_S, max(0.0, min([*running, now]) + self.timeout_s - now)
        )  # a file starting now is due last

    def _overdue(self) -> bool:
        """Mark the files whose decode passed the limit; whether there are any."""
        if not self.timeout_s:
            return False
        now = time.monotonic()
        overdue = [
            index
            for future, (index, _) in self.in_flight.items()
            if not future.done()
            and index in self.started
            and index not in self.stopped
            and now - self.started[index][1] > self.timeout_s
        ]
        self.stopped.update(overdue)
        return bool(overdue)

    @staticmethod
    def _a_worker_died(pool: ProcessPoolExecutor) -> bool:
        """A worker ended while jobs are in flight (killed by the system, most often)."""
        sentinels = [process.sentinel for process in list((pool._processes or {}).values())]
        return bool(sentinels and multiprocessing.connection.wait(sentinels, timeout=0))

    def _after_break(self, not_started: list[Job]) -> _PoolEnd:
        """Keep every result that arrived; sort the other jobs in flight by what they need next."""
        end = _PoolEnd(requeue=not_started)
        unanswered = []
        for future, (index, job) in self.in_flight.items():
            if future.done() and future.exception() is None:
                self.take(future.result())
            elif index in self.stopped:
                end.timed_out.append(job)
            else:
                unanswered.append(job)
        if self.stopped:  # the pool was stopped on purpose: the others did nothing wrong
            end.requeue[:0] = unanswered
        else:
            end.in_doubt = unanswered
        return end


def _retry_alone(job: Job, decode: Callable, timeout_s: float) -> tuple[str, bytes | None, Decoded]:
    """One file in a fresh single-worker pool: its result, or why it has none when it fails there too."""
    outcome: list = []
    end = _PoolRun(1, decode, outcome.append, timeout_s).run([job])
    if end.timed_out:
        return job[0], None, _timed_out(timeout_s)
    if end.in_doubt:
        return job[0], None, _worker_died()
    return outcome[0]


class _SlowFileWarning:
    """Decode in this process (workers: 1), where nothing can stop a decoder stuck in C: name the file, at least.

    One watching thread for the whole run (a timer per file cost more than a small file's decode on a busy board).
    """

    def __init__(self, timeout_s: float, log: Log):
        self.timeout_s, self.log = timeout_s, log
        self.changed = threading.Condition()
        self.current: tuple[str, float] | None = None  # (path, monotonic start) of the file being decoded
        self.finished = False
        self.watcher = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> _SlowFileWarning:
        if self.timeout_s:
            self.watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        with self.changed:
            self.finished = True
            self.changed.notify()
        if self.watcher.is_alive():
            self.watcher.join()

    def decode(self, job: Job, decode: Callable) -> tuple[str, bytes | None, Decoded]:
        if not self.timeout_s:
            return decode(job)
        with self.changed:
            self.current = (job[0], time.monotonic())
            self.changed.notify()
        try:
            return decode(job)
        finally:
            with self.changed:
                self.current = None

    def _watch(self) -> None:
        warned = None
        with self.changed:
            while not self.finished:
                current = self.current
                if current is None or current is warned:
                    self.changed.wait()
                    continue
                remaining = current[1] + self.timeout_s - time.monotonic()
                if remaining > 0:
                    self.changed.wait(remaining)
                    continue
                warned = current
                self.log(
                    f"{current[0]}: still decoding after data.decode_timeout_s ({self.timeout_s:g} s); with data.workers 1 "
                    "it cannot be stopped (interrupt, move the file aside, or set data.workers to 2 or more to have it skipped)"
                )


class ImageCache:
    def __init__(self, path: Path, log: Log = print):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        try:
            self.db = self._open()
        except sqlite3.OperationalError as err:  # locked, no permission, disk full: the file itself may be fine
            raise UserError(
                f"cannot use the decode cache {path} ({err}); check the folder's permissions and free space"
            ) from None
        except sqlite3.DatabaseError as err:  # not an SQLite file, or a malformed one
            damaged = path.with_name(path.name + ".damaged")
            for leftover in (damaged, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
                leftover.unlink(missing_ok=True)
            os.replace(path, damaged)
            log(
                f"decode cache {path} is damaged ({err}); moved it to {damaged.name} and rebuilding it (every image is decoded again)"
            )
            self.db = self._open()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(str(self.path))
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(_SCHEMA)
            problems = [row[0] for row in db.execute("PRAGMA quick_check")]
            if problems != ["ok"]:
                raise sqlite3.DatabaseError("; ".join(problems[:3]))
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def __enter__(self) -> ImageCache:
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(sqlite3.OperationalError):  # a full disk was reported where it happened
            self.db.commit()
        self.db.close()

    def png(self, content: bytes) -> bytes:
        row = self.db.execute("SELECT png FROM images WHERE content_sha256 = ?", (content,)).fetchone()
        if row is None or row[0] is None:
            raise KeyError(f"content {content.hex()[:16]} has no decoded image in {self.path}")
        return row[0]

    def _known(self, contents: set[bytes]) -> dict[bytes, Decoded]:
        rows = self.db.execute("SELECT content_sha256, pixel_sha256, phash, features, reason, detail FROM images")
        return {
            row[0]: Decoded(row[1] or b"", row[2] or b"", row[3] or b"", row[4] or "", row[5] or "")
            for row in rows
            if row[0] in contents
        }

    def _store(self, content: bytes, png: bytes | None, decoded: Decoded) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO images VALUES (?, ?, ?, ?, ?, ?, ?)",
            (content, png, decoded.pixel_sha256, decoded.phash, decoded.features, decoded.reason, decoded.detail),
        )

    def decode_configured(
        self, paths: list[str], config: DataConfig, progress: Callable, log: Log
    ) -> tuple[dict[str, Decoded], dict[str, bytes]]:
        """decode_all with data.image_size, data.workers (0: one per core), data.max_pixels, data.decode_timeout_s
        and data.harmonise."""
        progress(0, len(set(paths)))
        harmonised = config.harmonise != harmonise_method.NONE
        return self.decode_all(
            paths,
            config.image_size,
            workers_of(config),
            progress,
            config.max_pixels,
            log,
            decode=functools.partial(decode_one, harmonise=config.harmonise) if harmonised else None,
            timeout_s=config.decode_timeout_s,
        )

    def decode_all(
        self,
        paths: Iterable[str],
        size: int,
        workers: int,
        progress: Callable[[int], None],
        max_pixels: int = DEFAULT_MAX_PIXELS,
        log: Log = print,
        decode: Callable | None = None,
        timeout_s: float = 0.0,
    ) -> tuple[dict[str, Decoded], dict[str, bytes]]:
        """(Decoded per path, content sha256 per readable path): from the cache when the content is known,
        else decoded in `workers` processes, each file within `timeout_s` seconds (0: no limit).
        `decode` replaces decode_one (tests kill or hang workers with it)."""
        decode = decode or decode_one
        paths = list(dict.fromkeys(paths))
        # One thread: ~0.3 s per 200 MB here, and hashing threads fought over the GIL (2-4x slower on a busy machine).
        contents = {path: content for path, content in zip(paths, map(_content_or_none, paths)) if content is not None}
        by_content = self._known(set(contents.values()))
        jobs = list(
            {
                content: (path, size, max_pixels) for path, content in contents.items() if content not in by_content
            }.values()
        )
        stored = 0

        def take(outcome: tuple[str, bytes | None, Decoded]) -> None:
            nonlocal stored
            path, png, decoded = outcome
            if decoded.reason not in _NOT_CACHED:
                self._store(contents[path], png, decoded)
            by_content[contents[path]] = decoded
            progress(1)
            stored += 1
            if stored % _COMMIT_EVERY == 0:
                self.db.commit()  # a killed run keeps what it decoded

        try:
            if workers <= 1 or (len(jobs) <= 1 and not timeout_s):
                keep_freed_buffers()  # in this process: no pool to start for a single worker
                with _SlowFileWarning(timeout_s, log) as here:
                    for job in jobs:
                        take(here.decode(job, decode))
            else:
                self._decode_parallel(jobs, workers, decode, take, log, timeout_s)
        except sqlite3.OperationalError as err:
            raise UserError(
                f"writing the decode cache {self.path} failed ({err}); free some space (or use another --data-dir) "
                "and re-run prepare: the previous data set is untouched, and what was decoded so far is kept"
            ) from None
        finally:
            with contextlib.suppress(sqlite3.OperationalError):
                self.db.commit()
        unreadable = Decoded(reason="missing", detail="file not found or not readable")
        results = {path: by_content[contents[path]] if path in contents else unreadable for path in paths}
        progress(len(paths) - len(jobs))  # cached, unreadable, or the same bytes as another path
        return results, contents

    def _decode_parallel(
        self, jobs: list[Job], workers: int, decode: Callable, take: Callable, log: Log, timeout_s: float
    ) -> None:
        """Decode in a pool. A file over the time limit, or the files a worker that died may have held, are
        retried one by one, each alone in a fresh worker; then the rest go on in a new pool."""
        remaining = jobs
        while remaining:
            end = _PoolRun(min(workers, len(remaining)), decode, take, timeout_s).run(remaining)
            for job in end.timed_out:
                log(
                    f"{job[0]}: still decoding after data.decode_timeout_s ({timeout_s:g} s); "
                    "stopped its worker, retrying it alone in a fresh one"
                )
            if end.in_doubt:
                log(
                    f"a decode worker died (killed by the system?) while decoding one of: {', '.join(job[0] for job in end.in_doubt)}; "
                    "retrying each of them alone in a fresh worker"
                )
            for job in end.timed_out + end.in_doubt:
                outcome = _retry_alone(job, decode, timeout_s)
                if outcome[2].reason in (DECODE_TIMEOUT, WORKER_DIED):
                    log(f"skipped {job[0]}: {outcome[2].detail}")
                take(outcome)
            remaining = end.requeue
