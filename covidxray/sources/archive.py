"""Safe, idempotent unpacking of zip and tar(.gz) archives.

Archives come from the internet, so no member may land outside the target:
absolute names, `..` components and links pointing out of the target stop
the extraction with an error instead of being trusted. Extraction goes to
`<target>.partial` and is renamed into place with a marker recording which
archive it came from, so an interrupted unpack never looks finished and an
unchanged archive is never unpacked twice.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shutil
import stat
import tarfile
import zipfile
import zlib
from pathlib import Path
from typing import Callable

from covidxray.errors import UserError

MARKER = ".covidxray-extracted"
Say = Callable[[str], None]


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


def _extract_zip(archive: Path, dest: Path) -> None:
    with zipfile.ZipFile(archive) as bundle:
        for info in bundle.infolist():
            name = _check_name(archive, info.filename)
            if stat.S_ISLNK(info.external_attr >> 16):
                _check_link(archive, name, bundle.read(info).decode("utf-8", "replace"), relative_to_member=True)
                continue  # zipfile would write the link as a text file; no layout needs links
            if name != ".":
                bundle.extract(info, dest)


def _extract_tar(archive: Path, dest: Path) -> None:
    with tarfile.open(archive) as bundle:
        for member in bundle:  # one forward pass: a .tar.gz is never decompressed twice
            name = _check_name(archive, member.name)
            if member.issym() or member.islnk():
                _check_link(archive, name, member.linkname, relative_to_member=member.issym())
            elif not (member.isfile() or member.isdir()):
                continue  # devices and fifos have no place in an image collection
            try:
                bundle.extract(member, dest, filter="data")
            except tarfile.FilterError as err:
                raise _unsafe(archive, member.name, str(err)) from None


def archive_stem(name: str) -> str:
    """`ZhangLabData.zip` -> `ZhangLabData`, `OCT2017.tar.gz` -> `OCT2017`."""
    return re.sub(r"(\.tar)?\.(zip|tar|tgz|gz|bz2|xz)$", "", name, flags=re.I)


def extract(archive: Path, target: Path, say: Say = print, verify: Callable[[Path], None] | None = None) -> Path:
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
        unpack(archive, partial)
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
