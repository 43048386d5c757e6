"""Walking collection folders: find the layout root, list images, account for junk.

Archives wrap their content in varying top folders (`COVID-19-master/`,
`CellData/`, `chest_xray/`), users point --from at a parent or the folder
itself, and macOS leaves `__MACOSX/`, `._*` and `.DS_Store` behind. These
helpers make all of that one rule instead of one per adapter.

Nothing in a folder is passed over without a word: a file that is not an
image, a broken link, each becomes a Dropped; a folder that cannot be read
stops the run with its name. And no image path leaves the collection:
`within` is the one test, applied by prepare to every Record of every
adapter (a name in metadata.csv such as `../../etc/passwd` or an absolute
path is dropped, never read).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

from covidxray.errors import UserError
from covidxray.records import IMAGE_SUFFIXES, Dropped

MACOS_JUNK_DIR = "__MACOSX"
OUTSIDE = "path leads outside the collection folder ('..' or an absolute path); not read"
BROKEN_LINK = "broken symbolic link (its target is missing, or it points to itself)"


def within(root: Path, path: Path) -> bool:
    """Whether `path` lies inside `root` by its name: no absolute path elsewhere, no '..' climbing out, no NUL byte.

    Symbolic links are followed, not judged: a folder of links is a user's own way to pick a subset of a
    collection (tests/test_quality.py does it), and archives cannot bring links that point out
    (covidxray/sources/archive.py refuses them). What a metadata file names is where the danger lies.
    """
    top, full = os.path.abspath(root), os.path.abspath(path)
    return "\x00" not in full and os.path.commonpath([top, full]) == top


def unreadable(err: PermissionError) -> UserError:
    return UserError(
        f"cannot read {err.filename} (permission denied); make it readable (e.g. chmod -R u+rX) "
        "or move it out of the source folder"
    )


def entries(folder: Path) -> list[Path]:
    """The folder's entries, sorted; UserError when it cannot be read (a silent skip would lose its images)."""
    try:
        return sorted(folder.iterdir())
    except PermissionError as err:
        raise unreadable(err) from None


def is_junk(path: Path) -> bool:
    """Hidden files, macOS AppleDouble `._*` companions and `.DS_Store`."""
    return path.name.startswith(".") or path.name == MACOS_JUNK_DIR


def subdirs(folder: Path) -> list[Path]:
    return [p for p in entries(folder) if p.is_dir() and not is_junk(p)]


def find_root(tree: Path, is_root: Callable[[Path], bool], max_depth: int = 3) -> Path | None:
    """The shallowest folder under `tree` (itself included) that `is_root` accepts.

    Shallowest-first is what skips nested duplicate copies such as Kaggle's
    `chest_xray/chest_xray/`; ties go to the alphabetically first folder.
    """
    queue = deque([(Path(tree), 0)])
    while queue:
        folder, depth = queue.popleft()
        try:
            found = is_root(folder)
        except PermissionError as err:
            raise unreadable(err) from None
        if found:
            return folder
        if depth < max_depth:
            queue.extend((child, depth + 1) for child in subdirs(folder))
    return None


def list_images(folder: Path) -> Iterator[Path | Dropped]:
    """Image files of `folder` (sorted), and a Dropped for every other file in it, broken links included."""
    for path in entries(folder):
        if path.is_dir():
            continue
        if not path.is_file():
            broken = path.is_symlink() and not path.exists()
            yield Dropped(BROKEN_LINK if broken else "not a regular file (a pipe, socket or device)", str(path))
            continue
        if path.suffix.lower() in IMAGE_SUFFIXES:
            if path.name.startswith("._"):
                yield Dropped("macOS metadata file (._*), not an image", str(path))
            else:
                yield path
        elif is_junk(path):
            yield Dropped("hidden or macOS metadata file, not an image", str(path))
        else:
            yield Dropped("not an image file", str(path), f"suffix {path.suffix or '(none)'}")
