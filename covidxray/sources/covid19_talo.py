"""muhammedtalo/COVID-19: `X-Ray Image DataSet/{Covid-19,No_findings,Pneumonia}`.

No_findings and Pneumonia are NIH ChestX-ray8 files whose names carry the
patient (`00001280_004.png`). The Covid-19 images are ieee8023 copies (re-cropped,
rescaled, re-encoded) under ieee8023's file names, without patient data. Their
patients come from a table shipped with the package, derived from ieee8023's
metadata.csv (data/ieee8023_patients.csv, CC BY-NC-SA 4.0 like its source): a
talo COVID image gets the very id the `covid-chestxray` adapter gives its
original, so talo alone splits ieee8023 patients soundly and together with
covid-chestxray the two are one patient even before dedup. A name the table
does not know (a later ieee8023 image) falls back to grouping the images of one
published case (figure panels, follow-up days, views) by their shared name
stem, which can only merge patients, never split one.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterator
from functools import lru_cache
from importlib import resources
from pathlib import Path

from covidxray.records import Dropped, Record
from covidxray.sources.base import register_source
from covidxray.sources.fetch import DescribedSource, DownloadOptions
from covidxray.sources.layout import list_images, subdirs

DATA_FOLDER = "X-Ray Image DataSet"
IEEE8023_SOURCE = "covid-chestxray"  # the adapter whose patient ids talo's COVID images share
_NIH = re.compile(r"^(\d{8})_\d{3}$")
_UUID = re.compile(r"^[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$", re.I)
# A trailing panel letter (-a, _b2, f1a), follow-up day (-day6) or view (-PA) names one image of a case.
_CASE_SUFFIX = re.compile(r"([-_](day\d+|pa|ap|l|[a-z]\d?)|(?<=\d)[a-z])$", re.I)


def case_of(stem: str) -> str:
    """`jkms-35-e79-g001-l-a` -> `jkms-35-e79-g001`; `covid-19-pneumonia-24-day6` -> `covid-19-pneumonia-24`."""
    if _UUID.match(stem):
        return stem
    while (shorter := _CASE_SUFFIX.sub("", stem)) != stem and shorter:
        stem = shorter
    return stem


@lru_cache(maxsize=1)
def ieee8023_patients() -> dict[str, str]:
    """ieee8023 image file name (lower case) -> patientid, from the shipped table."""
    text = resources.files("covidxray.sources").joinpath("data/ieee8023_patients.csv").read_text()
    rows = csv.DictReader(line for line in io.StringIO(text) if not line.startswith("#"))
    return {row["filename"].lower(): row["patientid"] for row in rows}


def known_patient(file_name: str) -> str | None:
    """The patient id a file name proves: an NIH id, or the covid-chestxray id of an ieee8023 file name; else None."""
    if match := _NIH.match(Path(file_name).stem):
        return f"nih:{match[1]}"
    patient = ieee8023_patients().get(file_name.lower())
    return f"{IEEE8023_SOURCE}:{patient}" if patient else None


def patient_of(file_name: str) -> tuple[str, str]:
    """(namespace, patient) of a talo image: ieee8023 copies keep covid-chestxray's patient, so that both copies of
    one patient split together; NIH ids and case stems are talo's own (no other source here has NIH images)."""
    known = known_patient(file_name)
    if known and known.startswith(f"{IEEE8023_SOURCE}:"):
        return IEEE8023_SOURCE, known.removeprefix(f"{IEEE8023_SOURCE}:")
    return CovidTaloSource.name, known or f"case:{case_of(Path(file_name).stem)}"


@register_source
class CovidTaloSource(DescribedSource[DownloadOptions]):
    name = "covid19-talo"
    archive_key = "github-master"

    def is_root(self, folder: Path) -> bool:
        return (folder / DATA_FOLDER).is_dir() or ((folder / "Covid-19").is_dir() and (folder / "No_findings").is_dir())

    def records(self, root: Path) -> Iterator[Record | Dropped]:
        data = root / DATA_FOLDER if (root / DATA_FOLDER).is_dir() else root
        for class_dir in subdirs(data):
            label = self.descriptor.label_for(class_dir.name)
            for item in list_images(class_dir):
                if isinstance(item, Dropped):
                    yield item
                elif label is None:
                    yield Dropped(f"unknown class folder {class_dir.name!r}", str(item))
                else:
                    namespace, patient = patient_of(item.name)
                    yield self.record(item, label, patient, namespace=namespace, view="frontal")
