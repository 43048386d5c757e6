"""muhammedtalo/COVID-19: `X-Ray Image DataSet/{Covid-19,No_findings,Pneumonia}`.

No_findings and Pneumonia are NIH ChestX-ray8 files whose names carry the
patient (`00001280_004.png`). The Covid-19 images are ieee8023 copies without
patient data; images of one published case (figure panels, follow-up days,
views) are grouped by their shared name stem, which can only merge patients,
never split one, so the split stays leak-free.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

from covidxray.sources.base import Dropped, Record, register_source
from covidxray.sources.fetch import DescribedSource
from covidxray.sources.layout import list_images, subdirs

DATA_FOLDER = "X-Ray Image DataSet"
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


def patient_of(stem: str) -> str:
    match = _NIH.match(stem)
    return f"nih:{match[1]}" if match else f"case:{case_of(stem)}"


@register_source
class CovidTaloSource(DescribedSource):
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
                    yield Record(image=item, label=label, patient_id=f"{self.name}:{patient_of(item.stem)}", source=self.name, view="frontal")
