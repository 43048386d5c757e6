"""Mendeley rscbjbr9sj (Kermany, Zhang, Goldbaum): pediatric chest X-rays and retinal OCT.

One adapter reads both releases (v2: ChestXRay2017.zip and OCT2017.tar.gz;
v3: ZhangLabData.zip with CellData/, renamed files) and both parts: chest
X-rays feed the chest tasks, OCT the separate `oct` task. `part` picks which,
so a chest run never downloads or walks 100k OCT scans.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from covidxray.config import ConfigError
from covidxray.records import Dropped, Record
from covidxray.sources import zhanglab
from covidxray.sources.base import SourceContext, register_source
from covidxray.sources.descriptors import Archive
from covidxray.sources.fetch import DescribedSource, DownloadOptions

PARTS = {"chest": ("PNEUMONIA",), "oct": ("CNV", "DME", "DRUSEN")}  # folders that identify each part's root
VERSIONS = (2, 3)


@dataclass
class KermanyOptions(DownloadOptions):
    version: int = 3  # Mendeley release to download: 2 (separate chest and OCT archives) or 3 (one zip)
    part: str = "chest"  # chest (chest X-rays, tasks chest3/chest4) or oct (task oct)


@register_source
class KermanySource(DescribedSource[KermanyOptions]):
    name = "kermany"
    Options = KermanyOptions

    def __init__(self, options: KermanyOptions | None = None, context: SourceContext | None = None):
        super().__init__(options, context)
        if self.options.part not in PARTS:
            raise ConfigError(f"data.sources.kermany.part: {self.options.part!r} is not one of {', '.join(PARTS)}")
        if self.options.version not in VERSIONS:
            raise ConfigError(
                f"data.sources.kermany.version: {self.options.version!r} is not one of {', '.join(map(str, VERSIONS))}"
            )

    def archive(self) -> Archive:
        return self.descriptor.archive(f"v{self.options.version}-{self.options.part}")

    def is_root(self, folder: Path) -> bool:
        return zhanglab.is_split_tree(folder, PARTS[self.options.part])

    def records(self, root: Path) -> Iterator[Record | Dropped]:
        part = self.options.part
        return zhanglab.records(
            self.record, root, self.descriptor, part=part, view="frontal" if part == "chest" else "oct"
        )
