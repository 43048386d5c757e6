"""Walking collection folders: find the layout root, list images, account for junk.

Archives wrap their content in varying top folders (`COVID-19-master/`,
`CellData/`, `chest_xray/`), users point --from at a parent or the folder
itself, and macOS leaves `__MACOSX/`, `._*` and `.DS_Store` behind. These
helpers make all of that one rule instead of one per adapter.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

from covidxray.records import IMAGE_SUFFIXES, Dropped

MACOS_JUNK_DIR = "__MACOSX"


def is_junk(path: Path) -> bool:
    """Hidden files, macOS AppleDouble `._*` companions and `.DS_Store`."""
    return path.name.startswith(".") or path.name == MACOS_JUNK_DIR


def subdirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not is_junk(p))


def find_root(tree: Path, is_root: Callable[[Path], bool], max_depth: int = 3) -> Path | None:
    """The shallowest folder under `tree` (itself included) that `is_root` accepts.

    Shallowest-first is what skips nested duplicate copies such as Kaggle's
    `chest_xray/chest_xray/`; ties go to the alphabetically first folder.
    """
    queue = deque([(Path(tree), 0)])
    while queue:
        folder, depth = queue.popleft()
        if is_root(folder):
            return folder
        if depth < max_depth:
            queue.extend((child, depth + 1) for child in subdirs(folder))
    return None


def list_images(folder: Path) -> Iterator[Path | Dropped]:
    """Image files of `folder` (sorted), and a Dropped for every other file in it."""
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        if path.suffix.lower() in IMAGE_SUFFIXES:
            if path.name.startswith("._"):
                yield Dropped("macOS metadata file (._*), not an image", str(path))
            else:
                yield path
        elif is_junk(path):
            yield Dropped("hidden or macOS metadata file, not an image", str(path))
        else:
            yield Dropped("not an image file", str(path), f"suffix {path.suffix or '(none)'}")
