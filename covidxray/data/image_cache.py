"""Decode every image once: resized PNG + dedup hashes, cached on disk.

Decoding dominates `prepare`. Dedup must run before the patient split and
the split before shards are planned, so a naive pipeline decodes twice
(once to hash, once to shard). Instead one parallel pass turns each file
into everything later stages need: the resized PNG that goes into the shard,
the exact pixel digest, the perceptual hash and the local features of the
geometric near-duplicate check. These live in one SQLite file
under `<data_dir>/cache/`, keyed by path, size and mtime, so a re-run or a
resumed run decodes only new or changed files, and shards are written from
the cache without decoding again. The file name carries the image size and a
fingerprint of the preprocessing and hash definitions, so a change to either
starts a fresh cache; deleting `cache/` is always safe (it costs one decode).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import multiprocessing
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from covidxray.data import dedup, near_duplicates, preprocess

_SCHEMA = """CREATE TABLE IF NOT EXISTS images (
    path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER,
    png BLOB, pixel_sha256 BLOB, phash BLOB, features BLOB, reason TEXT, message TEXT)"""
_COMMIT_EVERY = 64
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


@dataclass(frozen=True)
class Decoded:
    """The outcome for one file: its hashes, or the countable reason it is unusable."""

    pixel_sha256: bytes = b""
    phash: bytes = b""
    features: bytes = b""  # near_duplicates.features(): what the geometric duplicate check needs, without decoding again
    reason: str = ""
    message: str = ""

    @property
    def ok(self) -> bool:
        return not self.reason


def cache_path(data_dir: Path, image_size: int) -> Path:
    definition = json.dumps([preprocess.PREPROCESSING, dedup.HASH_VERSION], sort_keys=True)
    tag = hashlib.sha256(definition.encode()).hexdigest()[:12]
    return Path(data_dir) / "cache" / f"decoded-{image_size}px-{tag}.sqlite"


def keep_freed_buffers() -> bool:
    """Let this process reuse freed image buffers instead of handing them back to the kernel.

    A decoded radiograph (1 MB at 1024 px, tens of MB for a large 16-bit DICOM)
    is above glibc's default mmap threshold, so every decode maps, page-faults
    and unmaps fresh memory; reusing it decodes ~15% faster (scripts/bench_prepare.py).
    Memory already freed is kept up to 64 MB. False where libc has no mallopt (not glibc).
    """
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # libc is already loaded: no library search (a subprocess)
    return bool(mallopt and mallopt(_M_MMAP_THRESHOLD, 32 << 20) and mallopt(_M_TRIM_THRESHOLD, 64 << 20))


def decode_one(job: tuple[str, int]) -> tuple[str, bytes | None, Decoded]:
    """Worker: one file -> (path, resized PNG or None, Decoded). Never raises: one bad file must not end a run."""
    path, size = job
    try:
        gray = preprocess.load_gray(path)
        small = preprocess.resize_square(gray, size)
        thumb_source = small if size >= dedup.PHASH_INPUT else gray
        signatures = Decoded(dedup.pixel_digest(gray), dedup.perceptual_hash(thumb_source), near_duplicates.features(gray))
        return path, preprocess.encode_png(small), signatures
    except preprocess.ImageError as err:
        return path, None, Decoded(reason=err.reason, message=str(err))
    except Exception as err:  # decoder bugs on hostile files (cv2.error, MemoryError, ...) are that file's problem
        return path, None, Decoded(reason="unreadable", message=f"{path}: cannot decode ({err.__class__.__name__}: {err})")


class ImageCache:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(str(path))
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute(_SCHEMA)

    def __enter__(self) -> "ImageCache":
        return self

    def __exit__(self, *exc) -> None:
        self.db.commit()
        self.db.close()

    def png(self, path: str) -> bytes:
        row = self.db.execute("SELECT png FROM images WHERE path = ?", (path,)).fetchone()
        if row is None or row[0] is None:
            raise KeyError(f"{path} has no decoded image in {self.path}")
        return row[0]

    def _known(self) -> dict[str, tuple]:
        rows = self.db.execute("SELECT path, size, mtime_ns, pixel_sha256, phash, features, reason, message FROM images")
        return {row[0]: row[1:] for row in rows}

    def _store(self, path: str, stamp: tuple[int, int], png: bytes | None, decoded: Decoded) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO images VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (path, *stamp, png, decoded.pixel_sha256, decoded.phash, decoded.features, decoded.reason, decoded.message),
        )

    def decode_all(self, paths: Iterable[str], size: int, workers: int, progress: Callable[[int], None]) -> dict[str, Decoded]:
        """Decoded for every path: from the cache when the file is unchanged, else decoded in `workers` processes."""
        results: dict[str, Decoded] = {}
        stamps: dict[str, tuple[int, int]] = {}
        known = self._known()
        for path in dict.fromkeys(paths):
            try:
                info = os.stat(path)
            except OSError:
                results[path] = Decoded(reason="missing", message=f"{path}: file not found")
                progress(1)
                continue
            stamps[path] = (info.st_size, info.st_mtime_ns)
            row = known.get(path)
            if row is not None and tuple(row[:2]) == stamps[path]:
                results[path] = Decoded(row[2] or b"", row[3] or b"", row[4] or b"", row[5] or "", row[6] or "")
                progress(1)
        jobs = [(path, size) for path in stamps if path not in results]
        if not jobs:
            return results
        workers = max(1, min(workers, len(jobs)))
        pool = multiprocessing.get_context("spawn").Pool(workers, initializer=keep_freed_buffers) if workers > 1 else None
        if not pool:
            keep_freed_buffers()
        try:
            outcomes = pool.imap_unordered(decode_one, jobs, chunksize=4) if pool else map(decode_one, jobs)
            for done, (path, png, decoded) in enumerate(outcomes, 1):
                self._store(path, stamps[path], png, decoded)
                results[path] = decoded
                progress(1)
                if done % _COMMIT_EVERY == 0:
                    self.db.commit()  # a killed run keeps what it decoded
        finally:
            self.db.commit()
            if pool:
                pool.terminate()
        return results
