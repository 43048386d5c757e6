"""ieee8023/covid-chestxray-dataset: metadata.csv + images/, one row per image.

The CSV exists in several header generations (the later ones end in a trailing
comma, so every row has an extra empty field; the earliest have no `view`
column) and mixes X-rays with CT slices and CT volumes. Only frontal X-rays
are kept; every other row is dropped with the reason it was not used. A row
whose view is unknown (blank, '?', or no view column) is dropped unless the
source option `unknown_view: keep` says to take it as frontal: it may be a
lateral view or, before the modality column existed, a CT slice.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from covidxray.config import setting
from covidxray.errors import UserError
from covidxray.records import VOLUME_SUFFIXES, Dropped, Record
from covidxray.sources.base import register_source
from covidxray.sources.fetch import DescribedSource, DownloadOptions
from covidxray.sources.layout import OUTSIDE, within
from covidxray.sources.unmapped import unknown_finding

METADATA = "metadata.csv"
REQUIRED = ("patientid", "finding", "filename")  # `view` is missing from the earliest versions
UNKNOWN_VIEWS = ("", "?")


@dataclass
class CovidChestXrayOptions(DownloadOptions):
    """`unknown_view`: rows whose view is blank, '?' or not recorded at all (no view column): `drop`
    (default: they may be laterals or CT slices) or `keep` (taken as frontal X-rays)."""

    unknown_view: str = setting("drop", choices=("drop", "keep"))


def is_frontal(view: str) -> bool:
    """PA and every AP variant (AP, AP Supine, AP erect, AP semi erect, APS); not L, Axial, Coronal."""
    view = " ".join(view.upper().replace("-", " ").split())
    return view in ("PA", "AP", "APS") or view.startswith(("AP ", "PA "))


def read_metadata(path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """(line, row) pairs with header names stripped and lower-cased; the trailing empty column is ignored."""
    with open(path, newline="", encoding="utf-8", errors="replace") as handle:
        reader = csv.reader(handle)
        try:
            header = [name.strip().lower() for name in next(reader)]
        except StopIteration:
            raise UserError(f"{path} is empty; expected the covid-chestxray metadata header") from None
        except csv.Error as err:
            raise UserError(f"{path} line 1: malformed CSV header ({err})") from None
        missing = [name for name in REQUIRED if name not in header]
        if missing:
            raise UserError(
                f"{path}: column(s) {', '.join(missing)} missing from the header; is this the ieee8023 metadata.csv?"
            )
        try:
            for values in reader:
                if any(v.strip() for v in values):
                    yield reader.line_num, {name: value.strip() for name, value in zip(header, values) if name}
        except csv.Error as err:
            raise UserError(f"{path} line {reader.line_num}: malformed CSV ({err})") from None


@register_source
class CovidChestXraySource(DescribedSource[CovidChestXrayOptions]):
    name = "covid-chestxray"
    archive_key = "github-master"
    Options = CovidChestXrayOptions

    def is_root(self, folder: Path) -> bool:
        return (folder / METADATA).is_file() and (folder / "images").is_dir()

    def records(self, root: Path) -> Iterator[Record | Dropped]:
        for line, row in read_metadata(root / METADATA):
            yield self._record(root, f"{METADATA}:{line} ({row.get('filename', '')})", row)

    def _record(self, root: Path, where: str, row: dict[str, str]) -> Record | Dropped:
        filename, folder = row.get("filename", ""), row.get("folder") or "images"
        modality, view, finding = row.get("modality", ""), row.get("view", ""), row.get("finding", "")
        if not filename:
            return Dropped("row without filename", where)
        if folder.lower() == "volumes" or filename.lower().endswith(VOLUME_SUFFIXES):
            return Dropped("CT volume (volumes/), not a radiograph", where)
        if modality and modality.casefold() != "x-ray":
            return Dropped(f"modality {modality} is not X-ray", where)
        if view in UNKNOWN_VIEWS:
            if self.options.unknown_view != "keep":
                return Dropped(
                    "view unknown (blank, '?' or no view column); source option unknown_view: keep takes it as frontal",
                    where,
                    view,
                )
        elif not is_frontal(view):
            return Dropped(f"view {view} is not frontal", where)
        if not finding:
            return Dropped("row without finding", where)
        descriptor = self.descriptor
        label = descriptor.label_for(finding)
        if label is None:
            if descriptor.is_unlabelled(finding):
                return Dropped("finding not labelled yet (todo/Unknown)", where, finding)
            if (why := descriptor.exclusion(finding)) is not None:
                return Dropped(f"finding {finding!r} excluded: {why}", where, finding)
            return unknown_finding(finding, where)
        if not row.get("patientid"):
            return Dropped("row without patientid", where)
        image = root / folder / filename
        if not within(root, image):
            return Dropped(OUTSIDE, where, f"folder {folder!r}, filename {filename!r}")
        if not os.path.isfile(image):  # unlike Path.is_file, False for a name too long to exist
            return Dropped("image file listed in metadata.csv is missing", where, str(image))
        return self.record(image, label, row["patientid"], view="unknown" if view in UNKNOWN_VIEWS else view)
