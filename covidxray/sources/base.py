"""The one contract every dataset adapter meets.

An adapter knows three things about its collection: how to get it onto disk
(`fetch`), how to recognise its layout root there (`is_root`), and how to read
that layout into `Record`s (`records`). Everything after that — label
harmonisation, dedup, patient split, decoding, sharding — is shared pipeline
code and never special-cases a source.

The base is generic over the adapter's options (`Source[KermanyOptions]`), so
`self.options` has the adapter's own fields for a reader and a type checker.
What the run adds beyond an adapter's options (label overrides, extraction
limits, where to report) arrives as one `SourceContext` at construction.
"""

from __future__ import annotations

import dataclasses
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Generic, NamedTuple, TypeVar, cast

from covidxray.config import ConfigError
from covidxray.records import Dropped, Record
from covidxray.registry import Registry, first_line
from covidxray.sources.archive import ExtractLimits, Say
from covidxray.sources.download import say_stderr

if TYPE_CHECKING:
    from covidxray.config import DataConfig


@dataclass
class SourceOptions:
    """Options every source accepts; adapters subclass to add their own.

    `from_path` is an archive or folder already on disk (air-gapped clusters);
    without it the adapter downloads into its cache folder.
    """

    from_path: str = ""


@dataclass(frozen=True)
class SourceContext:
    """What a run tells every source beyond the source's own options.

    `label_overrides`: finding -> harmonised label from the config's data.label_overrides; adapters whose labels
    come from a descriptor's label map consult these first. `extract_limits`: how far an archive may expand
    (decompression-bomb guard). `say`: where download and unpack progress goes.
    """

    label_overrides: Mapping[str, str] = field(default_factory=dict)
    extract_limits: ExtractLimits = field(default_factory=ExtractLimits.of)
    say: Say = say_stderr

    @classmethod
    def of(cls, config: DataConfig) -> SourceContext:
        """The context a `prepare` of `config` gives its sources."""
        return cls(label_overrides=config.label_overrides, extract_limits=ExtractLimits.of(config))


class Fetched(NamedTuple):
    """Where `fetch` put a collection, and what prepare records in the manifest about where it came from."""

    root: Path
    provenance: dict[str, str | None]  # e.g. licence, homepage, url, sha256, from (None: a download without a URL)


OptionsT = TypeVar("OptionsT", bound=SourceOptions)


class Source(ABC, Generic[OptionsT]):
    """Base adapter. Subclasses set `name` and `Options` and implement `fetch`, `is_root` and `records`."""

    name: ClassVar[str] = ""
    # The adapter's options class: its fields are the source's config keys (data.sources.<name>.<key>).
    Options: ClassVar[type[SourceOptions]] = SourceOptions

    def __init__(self, options: OptionsT | None = None, context: SourceContext | None = None):
        # A ClassVar cannot name the type variable, so the default built from `Options` is cast to it.
        self.options: OptionsT = options if options is not None else cast(OptionsT, self.Options())
        self.context = context if context is not None else SourceContext()

    @abstractmethod
    def fetch(self, cache_dir: Path) -> Fetched:
        """The dataset root on disk (downloading or unpacking into `cache_dir` if needed) and its provenance."""

    @abstractmethod
    def is_root(self, folder: Path) -> bool:
        """Whether `folder` is this collection's layout root."""

    @abstractmethod
    def records(self, root: Path) -> Iterator[Record | Dropped]:
        """Yield one Record per usable image and one Dropped per unusable row/file."""

    def record(self, image: Path, label: str, patient: str, *, namespace: str = "", **fields: str) -> Record:
        """A Record of this source, its patient namespaced (by this source's name unless another source's
        `namespace` is given: a copy of that source's image) so ids never collide across sources."""
        return Record(
            image=image, label=label, patient_id=f"{namespace or self.name}:{patient}", source=self.name, **fields
        )

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls.Options)]


SOURCE_REGISTRY: Registry[type[Source]] = Registry("source", ConfigError)  # a source is named in data.sources


def register_source(cls: type[Source]) -> type[Source]:
    """Class decorator: make an adapter reachable by its `name` from config and CLI (described by its module's docstring)."""
    options = ", ".join(cls.option_names())
    return SOURCE_REGISTRY.add(cls.name, cls, f"{first_line(sys.modules[cls.__module__].__doc__)} Options: {options}.")
