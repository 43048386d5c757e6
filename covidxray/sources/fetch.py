"""The shared half of every real adapter: get the collection onto disk.

Three ways in, one way out: download the descriptor's archive (resumable,
checksum-verified), unpack an archive the user already has (`--from x.zip`),
or use a folder the user already unpacked (`--from ./folder`). Either way the
adapter's `is_root` test then finds its layout root inside, however deeply
the archive wrapped it. Adapters only say which archive they need and what
their root looks like.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, TypeVar

from covidxray.errors import UserError
from covidxray.files import atomic_write
from covidxray.sources.archive import archive_stem, extract, is_extracted
from covidxray.sources.base import Fetched, Source, SourceOptions
from covidxray.sources.descriptors import Archive, Descriptor, load_descriptor
from covidxray.sources.download import download, verify_sha256
from covidxray.sources.layout import find_root
from covidxray.urls import redacted


@dataclass
class DownloadOptions(SourceOptions):
    """`url`: a mirror to fetch instead of the descriptor's URL; `sha256`: the checksum to enforce
    (on the download, or on the archive given with from_path)."""

    url: str = ""
    sha256: str = ""


DownloadOptionsT = TypeVar("DownloadOptionsT", bound=DownloadOptions)


class DescribedSource(Source[DownloadOptionsT]):
    """An adapter whose collection is described by `datasets/<name>.yaml`."""

    Options: ClassVar[type[SourceOptions]] = DownloadOptions
    archive_key: ClassVar[str] = ""

    @property
    def descriptor(self) -> Descriptor:
        described = load_descriptor(self.name)
        overrides = self.context.label_overrides
        return described.with_overrides(overrides) if overrides else described

    def archive(self) -> Archive:
        return self.descriptor.archive(self.archive_key)

    def download(self, archive: Archive, folder: Path) -> tuple[Path, str]:
        """Put `archive` into `folder`; returns (path, sha256). Over HTTP unless an adapter knows better."""
        url = self.options.url or archive.url
        if not url:
            raise UserError(
                f"no download URL is known for {archive.file} of {self.name} ({archive.note}). Download it from "
                f"{self.descriptor.homepage} and pass it with --from, or set the source option url"
            )
        return download(url, folder / archive.file, self.options.sha256 or archive.sha256, say=self.context.say)

    def fetch(self, cache_dir: Path) -> Fetched:
        cache_dir = Path(cache_dir)
        provenance: dict[str, str | None] = {"licence": self.descriptor.licence, "homepage": self.descriptor.homepage}
        tree = (
            self._given(Path(self.options.from_path).expanduser(), cache_dir, provenance)
            if self.options.from_path
            else self._downloaded(cache_dir, provenance)
        )
        root = find_root(tree, self.is_root)
        if root is None:
            layout = self.descriptor.layout.splitlines()[0] if self.descriptor.layout else ""
            raise UserError(
                f"{tree} does not hold the {self.name} layout (expected {layout}). Pass the collection's "
                f"archive or its unpacked folder with --from; see datasets/{self.name}.yaml"
            )
        return Fetched(root, provenance)

    def _downloaded(self, cache_dir: Path, provenance: dict[str, str | None]) -> Path:
        """The descriptor's archive, downloaded and unpacked once into the cache; its receipt joins `provenance`."""
        archive = self.archive()
        tree = cache_dir / "extracted" / archive_stem(archive.file)
        receipt_path = tree.with_name(tree.name + ".json")
        receipt = _readable_receipt(receipt_path) if is_extracted(tree) else None
        if receipt is None:  # not unpacked yet, or unpacked by a version that could lose or half-write the receipt
            path, digest = self.download(archive, cache_dir / "downloads")  # a file already downloaded is kept
            url = self.options.url or archive.url  # None for a Kaggle download
            receipt = {"file": archive.file, "url": url and redacted(url), "sha256": digest}
            # before the unpack: a tree marked unpacked then always has its receipt, whenever a run stops
            receipt_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(receipt_path, json.dumps(receipt))
            extract(path, tree, self.context.say, limits=self.context.extract_limits)  # a no-op once unpacked
        provenance.update(receipt)
        return tree

    def _given(self, given: Path, cache_dir: Path, provenance: dict[str, str | None]) -> Path:
        """The user's own folder, or their archive unpacked into the cache; where it came from joins `provenance`."""
        if given.is_dir():
            provenance["from"] = str(given)
            return given
        if not given.is_file():
            raise UserError(
                f"{self.name}: from_path {given} does not exist; give the collection's archive or unpacked folder"
            )
        expected = self.options.sha256
        # One unpack folder per distinct archive path, so two archives of the same name never mix.
        tag = hashlib.sha256(str(given.resolve()).encode()).hexdigest()[:10]
        tree = cache_dir / "from" / f"{archive_stem(given.name)}-{tag}"
        extract(
            given,
            tree,
            self.context.say,
            verify=(lambda path: verify_sha256(path, expected)) if expected else None,
            limits=self.context.extract_limits,
        )
        provenance.update({"from": str(given), **({"sha256": expected} if expected else {})})
        return tree


def _readable_receipt(path: Path) -> dict | None:
    """What a download's receipt recorded, or None when it is missing or unreadable (then it is written again)."""
    try:
        receipt = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return receipt if isinstance(receipt, dict) else None
