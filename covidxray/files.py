"""Writing a file so a reader never sees half of it, and naming a file's bytes.

Contract: `atomic_path` is the one way covidxray publishes a file (or folder)
that another process or a later run may read. The content goes to a
`<name>.partial` beside the target, is flushed to disk, and only then renamed
over the target in one step: a crash leaves the old file or the new one,
never a mix, and a leftover `.partial` is always safe to delete.
`staged_path` + `publish` split the same steps for several files that
must appear together with a commit point between (prepare's tables, written
before its manifest switches, moved into place after it). `sha256_file` is
the one hash of a file's bytes (shards, downloads, the manifest, model files,
the decode cache key); `json_sha256` the one hash of a JSON document's content
(the manifest's seal, a sidecar bound to its model). `output_folder` creates a
folder the user named for output, or says in one line why it cannot be one.

Imports only the standard library and covidxray.errors.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from covidxray.errors import UserError

PARTIAL = ".partial"  # suffix of a file being written; a reader never opens one
_BLOCK = 1 << 20


def partial_path(path: Path) -> Path:
    return path.with_name(path.name + PARTIAL)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    """Push a regular file's bytes to disk, so the rename never publishes bytes still in flight."""
    if path.is_file():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def staged_path(path: str | Path) -> Path:
    """The temporary path beside `path` to write first (a killed writer's leftover there is removed)."""
    tmp = partial_path(Path(path))
    _remove(tmp)
    return tmp


def publish(tmp: Path, path: str | Path) -> None:
    """Put the finished `tmp` (from staged_path) in place of `path` in one rename, its bytes on disk first."""
    _fsync(tmp)
    os.replace(tmp, path)


def discard(tmp: Path) -> None:
    """Remove a staged file or folder that will not be published."""
    _remove(tmp)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path` for any writer (open, a library's save); on success it replaces `path`.

    On an exception the temporary file or folder is removed and `path` is untouched.
    A folder replaces only an absent or empty folder: remove the old one inside the block, after writing.
    """
    tmp = staged_path(path)
    try:
        yield tmp
        publish(tmp, path)
    except BaseException:
        discard(tmp)
        raise


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", **open_args) -> Iterator[IO]:
    """`open(path, mode)` whose content appears at `path` only when the block ends without an exception."""
    with atomic_path(path) as tmp, open(tmp, mode, **open_args) as handle:
        yield handle


def atomic_write(path: str | Path, content: str | bytes) -> None:
    with atomic_open(path, "wb" if isinstance(content, bytes) else "w") as handle:
        handle.write(content)


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MB blocks (a shard or an archive need not fit in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def output_folder(path: str | Path, option: str) -> Path:
    """Create `path` (and its parents) for output, or UserError saying why it cannot be one (a file, no permission)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        raise UserError(f"{option} {path}: {blocker} is a file, not a folder; choose another {option}") from None
    except PermissionError:
        raise UserError(
            f"{option} {path}: no permission to create it (or a folder above it); choose a folder you can write to, "
            "or change the permissions"
        ) from None
    except OSError as err:  # a read-only file system, a full disk
        raise UserError(f"{option} {path}: cannot create it ({err.strerror or err}); choose another {option}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(
            f"{option} {path}: no permission to write into it; choose a folder you can write to, or change its permissions"
        )
    return path


def json_sha256(content) -> str:
    """sha256 of sorted compact ASCII JSON: independent of formatting and key order."""
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Delay SIGINT and SIGTERM until the block ends (then they act as usual), so that an interrupt cannot split
    what must happen together: two renames that publish a pair of files, or a result and its line of output.

    Python runs signal handlers in the main thread between bytecodes, so swapping the handlers for one that only
    remembers the signal holds it whichever thread the kernel delivered it to (a signal mask would hold it only
    for the calling thread, and TensorFlow, LiteRT and OpenCV run threads of their own). Main thread only.
    """
    held: list[int] = []
    previous = {number: signal.signal(number, lambda received, _frame: held.append(received)) for number in HELD}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if held:
            signal.raise_signal(held[0])


HELD = (signal.SIGINT, signal.SIGTERM)
