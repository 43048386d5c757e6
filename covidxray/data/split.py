"""Patient-level stratified split: no patient ever appears in two splits.

Images of one patient are near-duplicates of each other; letting them straddle
train and test inflates every reported metric, so the unit of splitting is the
patient, stratified by the patient's (majority) class.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from covidxray.data.labels import Task
from covidxray.errors import UserError
from covidxray.sources.base import Record

SPLITS = ("train", "val", "test")


def split_by_patient(
    records: list[Record], task: Task, val_fraction: float, test_fraction: float, seed: int
) -> dict[str, list[Record]]:
    if not 0 <= val_fraction < 1 or not 0 <= test_fraction < 1 or val_fraction + test_fraction >= 1:
        raise UserError(f"val_fraction={val_fraction} and test_fraction={test_fraction} must be >= 0 and sum to < 1")
    by_patient: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        by_patient[record.patient_id].append(record)
    by_class: dict[str, list[str]] = defaultdict(list)
    for patient, images in sorted(by_patient.items()):
        majority = Counter(task.class_of(r.label) for r in images).most_common(1)[0][0]
        by_class[majority].append(patient)

    rng = np.random.default_rng(seed)
    splits: dict[str, list[Record]] = {name: [] for name in SPLITS}
    for cls in sorted(by_class):
        patients = [by_class[cls][i] for i in rng.permutation(len(by_class[cls]))]
        total = sum(len(by_patient[p]) for p in patients)
        targets = {"test": test_fraction * total, "val": val_fraction * total}
        filled = {"test": 0, "val": 0}
        for patient in patients:
            count = len(by_patient[patient])
            # Fill test, then val, up to their image targets; the rest trains.
            split = next((s for s in ("test", "val") if filled[s] + count / 2 <= targets[s]), "train")
            if split != "train":
                filled[split] += count
            splits[split].extend(by_patient[patient])
    for name in SPLITS:
        splits[name].sort(key=lambda r: r.record_id)
    return splits


def patients_overlap(splits: dict[str, list[Record]]) -> list[str]:
    """Patient ids found in more than one split (empty when the split is sound)."""
    seen: dict[str, str] = {}
    clashes = set()
    for name, records in splits.items():
        for record in records:
            if seen.setdefault(record.patient_id, name) != name:
                clashes.add(record.patient_id)
    return sorted(clashes)
