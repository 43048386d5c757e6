"""What a source hands to the pipeline: one `Record` per usable image, one `Dropped` per unusable row or file.

Contract: a Record's `label` is one of HARMONISED_LABELS (tasks later collapse
it to their class set, see covidxray/data/labels.py), its `patient_id` is
namespaced by source so ids never collide across sources, and its `image` is a
file whose name ends in one of IMAGE_SUFFIXES (or a suffix-less DICOM). Files
ending in VOLUME_SUFFIXES are 3-D scans, never a Record. Nothing a source
cannot use disappears silently: it becomes a Dropped with a countable reason.

Imports only the standard library, so every stage (and a training rank that
only reads manifest.json) can use these types without loading any adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HARMONISED_LABELS = (
    "normal",
    "pneumonia",  # pneumonia of unstated cause
    "pneumonia/bacterial",
    "pneumonia/viral",
    "pneumonia/fungal",
    "pneumonia/other",
    "covid-19",
    "tuberculosis",
    "oct/cnv",
    "oct/dme",
    "oct/drusen",
    "oct/normal",
)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".dcm", ".dicom")
VOLUME_SUFFIXES = (".nii", ".nii.gz", ".mha", ".mhd", ".nrrd")  # CT/MR volumes: refused by name, never decoded


@dataclass(frozen=True)
class Record:
    """One image of one patient, as a source describes it.

    `label` is the source's own finding, already mapped to HARMONISED_LABELS
    (e.g. "normal", "pneumonia/bacterial", "covid-19", "oct/cnv").
    """

    image: Path
    label: str
    patient_id: str
    source: str
    view: str = "PA"
    original_split: str = ""

    @property
    def record_id(self) -> str:
        return f"{self.source}:{self.image.name}:{self.patient_id}"


@dataclass(frozen=True)
class Dropped:
    """A row or file a source could not turn into a Record, and why."""

    reason: str
    where: str
    detail: str = ""
