"""Patient-level stratified split: no patient ever appears in two splits.

Images of one patient are near-duplicates of each other; letting them straddle
train and test inflates every reported metric, so the unit of splitting is the
patient, stratified by the patient's (majority) class.

Three modes (`make_splits`), all patient-disjoint:
- `data.split: patient`: every record split by patient into train/val/test fractions;
- `data.split: source`: a source's official test folder (Record.original_split)
  is the test split and val is carved by patient from its official train, so
  results compare with published ones on that test folder; records without an
  official split are split by patient as above;
- `data.holdout_source: NAME`: that source is the whole test split and the
  others are split by patient into train/val only, to measure the model on
  data from a place it never saw.
A patient that would straddle (in both official folders, or merged by dedup
with a held-out image) goes to test as a whole, and is counted in the report.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

import numpy as np

from covidxray.data.labels import Task
from covidxray.errors import UserError
from covidxray.manifest import SPLITS
from covidxray.records import Record

SPLIT_MODES = ("patient", "source")


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
        # prepare keeps only records of the task's classes, so every image here has one
        majority = Counter(c for r in images if (c := task.class_of(r.label)) is not None).most_common(1)[0][0]
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


def _group_by_patient(records: Iterable[Record]) -> dict[str, list[Record]]:
    by_patient: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        by_patient[record.patient_id].append(record)
    return by_patient


def _combine(*parts: dict[str, list[Record]]) -> dict[str, list[Record]]:
    splits: dict[str, list[Record]] = {name: [] for name in SPLITS}
    for part in parts:
        for name in SPLITS:
            splits[name].extend(part.get(name, []))
    for name in SPLITS:
        splits[name].sort(key=lambda r: r.record_id)
    return splits


def _to_test(patients: dict[str, list[Record]], forced: set[str], why: str) -> tuple[list[Record], dict]:
    """Records of the `forced` patients (all go to test), and how many came with the patient from elsewhere."""
    records = [r for p in sorted(forced) for r in patients[p]]
    straddling = {p for p in forced if any(_outside_test(r, why) for r in patients[p])}
    moved = sum(_outside_test(r, why) for p in straddling for r in patients[p])
    return records, {"patients_moved_to_test": len(straddling), "records_moved_to_test": moved}


def _outside_test(record: Record, why: str) -> bool:
    """True when `record` is from an official train/val folder (why="official") or not from the held-out source `why`."""
    return record.original_split not in ("", "test") if why == "official" else record.source != why


def split_by_official_folders(
    records: list[Record], task: Task, val_fraction: float, test_fraction: float, seed: int
) -> tuple[dict[str, list[Record]], dict]:
    """Official test folders -> test; official train/val -> train/val by patient; records without folders -> by patient."""
    patients = _group_by_patient(records)
    official_test = {p for p, recs in patients.items() if any(r.original_split == "test" for r in recs)}
    official_train = {
        p for p, recs in patients.items() if p not in official_test and any(r.original_split for r in recs)
    }
    test, report = _to_test(patients, official_test, "official")
    trainval = split_by_patient([r for p in official_train for r in patients[p]], task, val_fraction, 0.0, seed)
    unsplit = [r for p, recs in patients.items() if p not in official_test and p not in official_train for r in recs]
    rest = split_by_patient(unsplit, task, val_fraction, test_fraction, seed)
    report["records_without_official_split"] = len(unsplit)
    return _combine({"test": test}, trainval, rest), report


def split_holding_out(
    records: list[Record], task: Task, source: str, val_fraction: float, seed: int
) -> tuple[dict[str, list[Record]], dict]:
    """Every patient with an image of `source` -> test; everyone else by patient into train/val."""
    patients = _group_by_patient(records)
    held_out = {p for p, recs in patients.items() if any(r.source == source for r in recs)}
    test, report = _to_test(patients, held_out, source)
    others = split_by_patient(
        [r for p, recs in patients.items() if p not in held_out for r in recs], task, val_fraction, 0.0, seed
    )
    return _combine({"test": test}, others), report


def make_splits(
    records: list[Record],
    task: Task,
    mode: str,
    holdout_source: str,
    val_fraction: float,
    test_fraction: float,
    seed: int,
) -> tuple[dict[str, list[Record]], dict]:
    """The split the config asks for, and a report of it (mode, and patients moved to test to keep them whole)."""
    report: dict = {"mode": "holdout" if holdout_source else mode, "holdout_source": holdout_source}
    if holdout_source:
        splits, moved = split_holding_out(records, task, holdout_source, val_fraction, seed)
    elif mode == "source":
        splits, moved = split_by_official_folders(records, task, val_fraction, test_fraction, seed)
    else:
        splits, moved = split_by_patient(records, task, val_fraction, test_fraction, seed), {}
    return splits, {**report, **moved}
