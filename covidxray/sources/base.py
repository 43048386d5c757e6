"""The one contract every dataset adapter meets.

An adapter knows two things about its collection: how to get it onto disk
(`fetch`) and how to read its layout into `Record`s (`records`). Everything
after that — label harmonisation, dedup, patient split, decoding, sharding —
is shared pipeline code and never special-cases a source.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from covidxray.config import ConfigError
from covidxray.records import Dropped, Record
from covidxray.registry import Registry, first_line


@dataclass
class SourceOptions:
    """Options every source accepts; adapters subclass to add their own.

    `from_path` is an archive or folder already on disk (air-gapped clusters);
    without it the adapter downloads into its cache folder.
    """

    from_path: str = ""


class Source:
    """Base adapter. Subclasses set `name`, `Options`, and implement both methods."""

    name: ClassVar[str] = ""
    Options: ClassVar[type[SourceOptions]] = SourceOptions

    def __init__(self, options: SourceOptions | None = None):
        self.options = options if options is not None else self.Options()
        # finding -> harmonised label from the config's data.label_overrides; adapters whose labels come
        # from a descriptor's label map consult these first.
        self.label_overrides: dict[str, str] = {}

    def fetch(self, cache_dir: Path) -> Path:
        """Return the dataset root on disk, downloading or unpacking into `cache_dir` if needed."""
        raise NotImplementedError

    def records(self, root: Path) -> Iterator[Record | Dropped]:
        """Yield one Record per usable image and one Dropped per unusable row/file."""
        raise NotImplementedError

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls.Options)]


SOURCE_REGISTRY: Registry[type[Source]] = Registry("source", ConfigError)  # a source is named in data.sources


def register_source(cls: type[Source]) -> type[Source]:
    """Class decorator: make an adapter reachable by its `name` from config and CLI (described by its module's docstring)."""
    options = ", ".join(cls.option_names())
    return SOURCE_REGISTRY.add(cls.name, cls, f"{first_line(sys.modules[cls.__module__].__doc__)} Options: {options}.")
