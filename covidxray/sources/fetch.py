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
from typing import ClassVar

from covidxray.errors import UserError
from covidxray.sources.archive import ExtractLimits, archive_stem, extract, is_extracted
from covidxray.sources.base import Source, SourceOptions
from covidxray.sources.descriptors import Archive, Descriptor, load_descriptor
from covidxray.sources.download import download, say_stderr, verify_sha256
from covidxray.sources.layout import find_root
from covidxray.urls import redacted


@dataclass
class DownloadOptions(SourceOptions):
    """`url`: a mirror to fetch instead of the descriptor's URL; `sha256`: the checksum to enforce
    (on the download, or on the archive given with from_path)."""

    url: str = ""
    sha256: str = ""


class DescribedSource(Source):
    """An adapter whose collection is described by `datasets/<name>.yaml`."""

    Options: ClassVar[type[SourceOptions]] = DownloadOptions
    options: DownloadOptions  # each adapter narrows this to its own Options (built from that class, see Source)
    archive_key: ClassVar[str] = ""

    def __init__(self, options: SourceOptions | None = None):
        super().__init__(options)
        self.provenance: dict = {}  # what prepare records about where the data came from
        self.extract_limits = ExtractLimits.of()  # prepare sets the configured ones

    @property
    def descriptor(self) -> Descriptor:
        described = load_descriptor(self.name)
        return described.with_overrides(self.label_overrides) if self.label_overrides else described

    def archive(self) -> Archive:
        return self.descriptor.archive(self.archive_key)

    def is_root(self, folder: Path) -> bool:
        """Whether `folder` is this collection's layout root."""
        raise NotImplementedError

    def download(self, archive: Archive, folder: Path) -> tuple[Path, str]:
        """Put `archive` into `folder`; returns (path, sha256). Over HTTP unless an adapter knows better."""
        url = self.options.url or archive.url
        if not url:
            raise UserError(
                f"no download URL is known for {archive.file} of {self.name} ({archive.note}). Download it from "
                f"{self.descriptor.homepage} and pass it with --from, or set the source option url"
            )
        return download(url, folder / archive.file, self.options.sha256 or archive.sha256)

    def fetch(self, cache_dir: Path) -> Path:
        cache_dir = Path(cache_dir)
        self.provenance = {"licence": self.descriptor.licence, "homepage": self.descriptor.homepage}
        tree = (
            self._given(Path(self.options.from_path).expanduser(), cache_dir)
            if self.options.from_path
            else self._downloaded(cache_dir)
        )
        root = find_root(tree, self.is_root)
        if root is None:
            layout = self.descriptor.layout.splitlines()[0] if self.descriptor.layout else ""
            raise UserError(
                f"{tree} does not hold the {self.name} layout (expected {layout}). Pass the collection's "
                f"archive or its unpacked folder with --from; see datasets/{self.name}.yaml"
            )
        self.provenance["root"] = str(root)
        return root

    def _downloaded(self, cache_dir: Path) -> Path:
        archive = self.archive()
        tree = cache_dir / "extracted" / archive_stem(archive.file)
        receipt = tree.with_name(tree.name + ".json")
        if not is_extracted(tree):
            path, digest = self.download(archive, cache_dir / "downloads")
            extract(path, tree, say_stderr, limits=self.extract_limits)
            url = self.options.url or archive.url  # None for a Kaggle download
            receipt.write_text(json.dumps({"file": archive.file, "url": url and redacted(url), "sha256": digest}))
        if receipt.is_file():
            self.provenance.update(json.loads(receipt.read_text()))
        return tree

    def _given(self, given: Path, cache_dir: Path) -> Path:
        if given.is_dir():
            self.provenance["from"] = str(given)
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
            say_stderr,
            verify=(lambda path: verify_sha256(path, expected)) if expected else None,
            limits=self.extract_limits,
        )
        self.provenance.update({"from": str(given), **({"sha256": expected} if expected else {})})
        return tree
