"""Split modes (patient, source, hold-out): no patient in two splits, over many random record sets, and on real data."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

from covidxray.data.labels import get_task
from covidxray.data.split import SPLITS, make_splits, patients_overlap
from covidxray.records import Record

TASK = get_task("chest3")
LABELS = ("normal", "pneumonia/bacterial", "pneumonia/viral", "covid-19")
SOURCES = ("alpha", "beta", "gamma")


def random_records(rng: np.random.Generator) -> list[Record]:
    """Patients with 1-4 images; some with images in several sources (as dedup merges them) and both official folders."""
    records = []
    for p in range(int(rng.integers(5, 80))):
        home = SOURCES[int(rng.integers(len(SOURCES)))]
        official = rng.choice(["", "train", "test", "val"], p=[0.3, 0.4, 0.2, 0.1])
        for i in range(int(rng.integers(1, 5))):
            source = SOURCES[int(rng.integers(len(SOURCES)))] if rng.random() < 0.15 else home
            split = rng.choice(["train", "test"]) if rng.random() < 0.1 else official
            records.append(
                Record(
                    Path(f"/x/{p}-{i}.png"), str(rng.choice(LABELS)), f"patient-{p}", source, original_split=str(split)
                )
            )
    return records


def split_of_each_patient(splits) -> dict[str, set[str]]:
    found = defaultdict(set)
    for name, records in splits.items():
        for r in records:
            found[r.patient_id].add(name)
    return found


@pytest.mark.parametrize("seed", range(60))
def test_every_mode_keeps_each_patient_in_one_split_and_every_record_once(seed):
    rng = np.random.default_rng(seed)
    records = random_records(rng)
    for mode, holdout in (("patient", ""), ("source", ""), ("patient", "beta")):
        splits, report = make_splits(records, TASK, mode, holdout, 0.2, 0.2, seed)
        assert not patients_overlap(splits)
        assert all(len(s) == 1 for s in split_of_each_patient(splits).values())
        assert sorted(r.record_id for s in SPLITS for r in splits[s]) == sorted(r.record_id for r in records)
        if holdout:  # every held-out image in test, nothing else in test except patients it shares
            held_patients = {r.patient_id for r in records if r.source == holdout}
            assert {r.patient_id for r in splits["test"]} == held_patients
            sharing = {p for p in held_patients if any(r.source != holdout for r in records if r.patient_id == p)}
            assert report["patients_moved_to_test"] == len(sharing)
            assert report["records_moved_to_test"] == sum(
                r.source != holdout for r in records if r.patient_id in sharing
            )
        if (
            mode == "source"
        ):  # official test images stay in test; official train/val images never reach test unless their patient has a test image
            test_patients = {r.patient_id for r in records if r.original_split == "test"}
            assert all(r.patient_id in test_patients or not r.original_split for r in splits["test"])
            assert {r.record_id for r in records if r.original_split == "test"} <= {r.record_id for r in splits["test"]}
            both = {
                p
                for p in test_patients
                if any(r.original_split in ("train", "val") for r in records if r.patient_id == p)
            }
            assert report["patients_moved_to_test"] == len(both)


def test_cli_hold_out_source_on_the_real_samples(shared_data, tmp_path):
    """talo's Covid-19 images are copies of covid-chestxray originals: dedup merges those patients across the two sources."""
    data_dir = tmp_path / "data"
    result = run_cli(
        "prepare",
        "--source",
        f"covid-chestxray={shared_data / 'covid-chestxray-sample'}",
        "--source",
        f"covid19-talo={shared_data / 'covid19-talo-sample'}",
        "--hold-out-source",
        "covid19-talo",
        "--image-size",
        "64",
        "--data-dir",
        str(data_dir),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((data_dir / "manifest.json").read_text())
    assert manifest["split"]["mode"] == "holdout" and manifest["split"]["holdout_source"] == "covid19-talo"
    assert set(manifest["splits"]["test"]["sources"]) >= {"covid19-talo"}
    assert (
        "covid19-talo" not in manifest["splits"]["train"]["sources"]
        and "covid19-talo" not in manifest["splits"]["val"]["sources"]
    )
    import csv

    with open(data_dir / "splits.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    split_of = defaultdict(set)
    for row in rows:
        split_of[row["patient_id"]].add(row["split"])
    assert all(len(s) == 1 for s in split_of.values())
    talo_patients = {row["patient_id"] for row in rows if row["source"] == "covid19-talo"}
    assert all(split_of[p] == {"test"} for p in talo_patients)

    wrong = run_cli(
        "prepare",
        "--source",
        f"covid19-talo={shared_data / 'covid19-talo-sample'}",
        "--hold-out-source",
        "kermany",
        "--data-dir",
        str(tmp_path / "d2"),
    )
    assert wrong.returncode == 2 and "holdout_source" in wrong.stderr and "Traceback" not in wrong.stderr
