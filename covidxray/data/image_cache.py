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

The files are decoded in worker processes that may be killed, time out or be
interrupted: covidxray/data/decode_pool.py supervises them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sqlite3
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from covidxray.data import dedup, near_duplicates
from covidxray.data.decode_pool import DECODE_TIMEOUT, WORKER_DIED, Job, Log, decode_each
from covidxray.edge import harmonise as harmonise_method
from covidxray.edge import preprocess, radiograph_gate
from covidxray.edge.image_header import DEFAULT_MAX_PIXELS
from covidxray.errors import UserError, reraise_interrupt
from covidxray.files import sha256_file
from covidxray.manifest import CACHE_DIR

if TYPE_CHECKING:
    from covidxray.config import DataConfig

_SCHEMA_VERSION = 3  # 3: + near-duplicate features; 2: keyed by content sha256 (1 was path, size, mtime)
_SCHEMA = """CREATE TABLE IF NOT EXISTS images (
    content_sha256 BLOB PRIMARY KEY, png BLOB, pixel_sha256 BLOB, phash BLOB, features BLOB, reason TEXT, detail TEXT)"""
_COMMIT_EVERY = 64
# Outcomes that depend on this run's limits and machine (data.max_pixels, data.decode_timeout_s, free memory),
# not on the file alone: never cached, so raising a limit or lowering data.workers takes effect on the next run.
_NOT_CACHED = frozenset({DECODE_TIMEOUT, WORKER_DIED, "too-large"})


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


def _given_up(job: Job, reason: str, why: str) -> tuple[str, None, Decoded]:
    """decode_one's outcome for a file the decode pool gave up on (never cached: see _NOT_CACHED)."""
    return job[0], None, Decoded(reason=reason, detail=why)


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
            decode_each(jobs, decode, take, workers=workers, timeout_s=timeout_s, log=log, failed=_given_up)
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
