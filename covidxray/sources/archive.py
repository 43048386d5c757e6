"""Safe, idempotent unpacking of zip and tar(.gz) archives.

Archives come from the internet, so no member may land outside the target:
absolute names, `..` components and links pointing out of the target stop
the extraction with an error instead of being trusted. Extraction goes to
`<target>.partial` and is renamed into place with a marker recording which
archive it came from, so an interrupted unpack never looks finished and an
unchanged archive is never unpacked twice.

Extraction is bounded before a byte is written: the declared sizes may not
exceed data.max_extract_bytes in total, nor data.max_compression_ratio times
the archive's own size overall, nor the free disk; a zip member that inflates
beyond its declared size stops the extraction too. One rule bounds each
member's own ratio (`_Budget.check_ratio`): a zip member by the sizes its
header declares, before extraction; a member of a compressed tar, whose
compressed size no header records, by the compressed bytes read for it so
far, checked after every block it writes (so a 300 MiB member of zeros in a
tar.gz stops after a few MiB, though the archive overall expands only ~40x).
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import re
import shutil
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, cast

from covidxray.errors import UserError

MARKER = ".covidxray-extracted"
Say = Callable[[str], None]


_RATIO_MIN_BYTES = 1 << 20  # tiny members (a CSV, padding) may compress far better; they cannot hurt
_COPY_BLOCK = 1 << 20
_TAR_READ_BYTES = tarfile.RECORDSIZE * 20  # tarfile's own default


@dataclass(frozen=True)
class ExtractLimits:
    max_bytes: int
    max_ratio: float

    @classmethod
    def of(cls, data_config=None) -> ExtractLimits:
        """The limits of `data_config` (a DataConfig), or the defaults."""
        from covidxray.config import DataConfig

        config = data_config or DataConfig()
        return cls(config.max_extract_bytes, config.max_compression_ratio)


class _Budget:
    """Bytes an extraction may still write; every member is charged before it is written."""

    def __init__(self, archive: Path, dest: Path, limits: ExtractLimits):
        self.archive, self.dest, self.limits, self.written = archive, dest, limits, 0
        self.archive_bytes = max(archive.stat().st_size, 1)
        self.free = shutil.disk_usage(dest).free

    def _refuse(self, why: str, setting: str) -> UserError:
        return UserError(
            f"{self.archive}: {why}; refusing to extract it (a damaged archive or a decompression bomb). "
            f"If the archive is genuine, raise {setting} (--set data.{setting}=...)"
        )

    def check_ratio(self, name: str, size: int, compressed: int) -> None:
        """Refuse a member that expands `size` bytes from `compressed` bytes beyond max_compression_ratio."""
        if size > _RATIO_MIN_BYTES and size > self.limits.max_ratio * max(compressed, 1):
            raise self._refuse(
                f"member {name!r} expands {size / max(compressed, 1):.0f}x ({compressed:,} -> {size:,} bytes), "
                f"above max_compression_ratio {self.limits.max_ratio:g}",
                "max_compression_ratio",
            )

    def charge(self, name: str, size: int) -> None:
        self.written += size
        if self.written > self.limits.max_bytes:
            raise self._refuse(
                f"it expands to more than max_extract_bytes {self.limits.max_bytes:,} bytes (at member {name!r})",
                "max_extract_bytes",
            )
        if self.written > _RATIO_MIN_BYTES and self.written > self.limits.max_ratio * self.archive_bytes:
            raise self._refuse(
                f"it expands to more than {self.limits.max_ratio:g}x its own {self.archive_bytes:,} bytes "
                f"(at member {name!r})",
                "max_compression_ratio",
            )
        if self.written > self.free:
            raise UserError(
                f"{self.archive}: extracting needs more than the {self.free >> 20:,} MB free on the disk of {self.dest} "
                "(where it unpacks, in --data-dir); free some space there or choose another --data-dir"
            )


def _stamp(archive: Path) -> dict:
    info = archive.stat()
    return {"archive": str(archive.resolve()), "size": info.st_size, "mtime_ns": info.st_mtime_ns}


def is_extracted(target: Path) -> bool:
    return (Path(target) / MARKER).is_file()


def _unsafe(archive: Path, name: str, why: str) -> UserError:
    return UserError(f"{archive}: member {name!r} {why}; refusing to extract an archive that writes outside its folder")


def _check_name(archive: Path, name: str) -> str:
    """Normalised relative member name, or UserError when it would escape the target."""
    clean = name.replace("\\", "/")
    if clean.startswith("/") or re.match(r"^[A-Za-z]:", clean):
        raise _unsafe(archive, name, "has an absolute path")
    if ".." in clean.split("/"):
        raise _unsafe(archive, name, "contains '..'")
    return posixpath.normpath(clean)


def _check_link(archive: Path, name: str, link: str, relative_to_member: bool) -> None:
    """A link target must resolve inside the target (symlinks relative to their folder, hard links to the root)."""
    clean = link.replace("\\", "/")
    base = posixpath.dirname(name) if relative_to_member else ""
    resolved = posixpath.normpath(posixpath.join(base, clean))
    if clean.startswith("/") or resolved == ".." or resolved.startswith("../"):
        raise _unsafe(archive, name, f"links to {link!r} outside the archive")


def _copy_member(bundle: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path, archive: Path) -> None:
    """Write one member, never more bytes than it declares (its declared size was charged to the budget)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    left = info.file_size
    with bundle.open(info) as source, open(target, "wb") as out:
        for block in iter(lambda: source.read(_COPY_BLOCK), b""):
            left -= len(block)
            if left < 0:
                raise UserError(
                    f"{archive}: member {info.filename!r} inflates beyond its declared {info.file_size:,} bytes; "
                    "refusing to extract it (a damaged archive or a decompression bomb)"
                )
            out.write(block)


def _extract_zip(archive: Path, dest: Path, limits: ExtractLimits) -> None:
    budget = _Budget(archive, dest, limits)
    with zipfile.ZipFile(archive) as bundle:
        members = []
        for info in bundle.infolist():
            name = _check_name(archive, info.filename)
            if stat.S_ISLNK(info.external_attr >> 16):
                _check_link(archive, name, bundle.read(info).decode("utf-8", "replace"), relative_to_member=True)
                continue  # zipfile would write the link as a text file; no layout needs links
            if name != ".":
                budget.check_ratio(info.filename, info.file_size, info.compress_size)
                budget.charge(info.filename, info.file_size)
                members.append((name, info))
        for name, info in members:  # every size checked before the first byte is written
            if info.is_dir():
                (dest / name).mkdir(parents=True, exist_ok=True)
            else:
                _copy_member(bundle, info, dest / name, archive)


class _CountingReader(io.RawIOBase):
    """A read-only file that counts the bytes read from it: the compressed bytes a tar member has cost."""

    def __init__(self, raw):
        self.raw, self.consumed = raw, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = self.raw.readinto(buffer)
        self.consumed += count
        return count

    def seekable(self) -> bool:
        return self.raw.seekable()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()


def _copy_tar_member(
    bundle: tarfile.TarFile, member: tarfile.TarInfo, dest: Path, compressed: _CountingReader, budget: _Budget
) -> None:
    """Write one regular member block by block, its ratio checked against the compressed bytes read for it."""
    target = dest / member.name
    target.parent.mkdir(parents=True, exist_ok=True)
    # Its first bytes may come from the compressed block read for the member before it: credit it one block.
    start, written = compressed.consumed - _TAR_READ_BYTES, 0
    # Only regular files come here (the caller checks isfile()), and for those extractfile never returns None.
    with cast(IO[bytes], bundle.extractfile(member)) as source, open(target, "wb") as out:
        for block in iter(lambda: source.read(_COPY_BLOCK), b""):
            written += len(block)
            budget.check_ratio(member.name, written, compressed.consumed - start)
            out.write(block)


def _extract_tar(archive: Path, dest: Path, limits: ExtractLimits) -> None:
    budget = _Budget(archive, dest, limits)
    with open(archive, "rb", buffering=0) as raw:
        compressed = _CountingReader(raw)
        # One forward pass, so a .tar.gz is never decompressed twice; compressed data is read _TAR_READ_BYTES at a time.
        with tarfile.open(fileobj=compressed, mode="r|*", bufsize=_TAR_READ_BYTES) as bundle:
            for member in bundle:
                name = _check_name(archive, member.name)
                if member.issym() or member.islnk():
                    _check_link(archive, name, member.linkname, relative_to_member=member.issym())
                elif not (member.isfile() or member.isdir()):
                    continue  # devices and fifos have no place in an image collection
                budget.charge(member.name, member.size)  # a tar member is exactly its declared size
                try:
                    safe = tarfile.data_filter(member, str(dest))
                except tarfile.FilterError as err:
                    raise _unsafe(archive, member.name, str(err)) from None
                if safe.isfile():
                    _copy_tar_member(bundle, safe, dest, compressed, budget)
                else:
                    bundle.extract(safe, dest, filter="data")


def archive_stem(name: str) -> str:
    """`ZhangLabData.zip` -> `ZhangLabData`, `OCT2017.tar.gz` -> `OCT2017`."""
    return re.sub(r"(\.tar)?\.(zip|tar|tgz|gz|bz2|xz)$", "", name, flags=re.I)


def extract(
    archive: Path,
    target: Path,
    say: Say = print,
    verify: Callable[[Path], object] | None = None,
    limits: ExtractLimits | None = None,
) -> Path:
    """Unpack `archive` into `target` unless it already holds this very archive; returns `target`.

    `verify` (e.g. a checksum check) runs only when unpacking is actually needed.
    """
    archive, target = Path(archive), Path(target)
    if not archive.is_file():
        raise UserError(f"archive {archive} not found")
    stamp = _stamp(archive)
    marker = target / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return target
    if verify is not None:
        verify(archive)
    if zipfile.is_zipfile(archive):
        unpack = _extract_zip
    elif tarfile.is_tarfile(archive):
        unpack = _extract_tar
    else:
        raise UserError(
            f"{archive} is not a readable zip or tar archive (corrupt, truncated, or another format). "
            "Delete it and download again, or pass the unpacked folder with --from"
        )
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    say(f"extracting {archive.name} -> {target}")
    try:
        unpack(archive, partial, limits or ExtractLimits.of())
    except UserError:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, zlib.error) as err:
        shutil.rmtree(partial, ignore_errors=True)
        raise UserError(
            f"{archive} is corrupt or truncated ({err.__class__.__name__}: {err}). "
            "Delete it and download again, or pass the unpacked folder with --from"
        ) from None
    except OSError as err:
        shutil.rmtree(partial, ignore_errors=True)
        raise UserError(f"extracting {archive} into {partial} failed: {err}") from None
    (partial / MARKER).write_text(json.dumps(stamp))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    return target
