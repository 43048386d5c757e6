"""`prepare` on real-layout fixtures of all four collections: counts, dedup, patient split, resume, bad input."""

from __future__ import annotations

import csv
import json
import platform
import subprocess
import sys
from collections import Counter
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import run_cli
from layouts import (
    build_ieee8023,
    build_kaggle,
    build_mendeley_v2,
    build_mendeley_v3,
    build_talo,
    write_image,
    zip_tree,
)

from covidxray.config import load_config
from covidxray.data import image_cache
from covidxray.data.prepare import prepare
from covidxray.errors import UserError

DECODE_REASON = {"corrupt": "image unreadable", "truncated": "image unreadable", "empty": "image empty"}


def config(data_dir: Path, sources: dict, **data):
    return load_config(
        None,
        [
            {
                "data": {
                    "sources": sources,
                    "data_dir": str(data_dir),
                    "image_size": 64,
                    "records_per_shard": 6,
                    "workers": 1,
                    **data,
                }
            }
        ],
    ).data


@pytest.fixture(scope="module")
def collections(tmp_path_factory):
    """All four collections as a user has them on disk: two folders, two archives."""
    base = tmp_path_factory.mktemp("collections")
    ieee = build_ieee8023(base / "ieee")
    kaggle = build_kaggle(base / "kaggle", bad=True)
    kermany, _ = build_mendeley_v2(base / "mendeley")
    copies = {
        "ieee-copy-one.jpeg": ieee.root / "images" / "covid-1-PA.jpeg",
        "ieee-copy-two.jpeg": ieee.root / "images" / "F051E018-DAD1-4506-AD43-BE4CA29E960B.jpeg",
    }
    talo = build_talo(base / "talo", copies)
    day3 = cv2.imread(str(ieee.root / "images" / "covid-1-day3.png"), cv2.IMREAD_GRAYSCALE)
    reencoded = talo.root / "X-Ray Image DataSet" / "Covid-19" / "ieee-reencoded.jpg"  # a lossy, rescaled copy
    reencoded.write_bytes(
        cv2.imencode(".jpg", cv2.resize(day3, (80, 80), interpolation=cv2.INTER_AREA), [cv2.IMWRITE_JPEG_QUALITY, 70])[
            1
        ].tobytes()
    )
    talo.labels[reencoded.name], talo.patients[reencoded.name] = "covid-19", "covid19-talo:case:ieee-reencoded"
    return {
        "layouts": {"covid-chestxray": ieee, "chest-xray-pneumonia": kaggle, "kermany": kermany, "covid19-talo": talo},
        "sources": {
            "covid-chestxray": {"from_path": str(ieee.root)},
            "chest-xray-pneumonia": {"from_path": str(base / "kaggle")},
            "kermany": {"from_path": str(zip_tree(kermany.root, base / "ChestXRay2017.zip")), "version": 2},
            "covid19-talo": {"from_path": str(zip_tree(base / "talo", base / "COVID-19-master.zip"))},
        },
    }


@pytest.fixture(scope="module")
def prepared(collections, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("prepared") / "data"
    lines: list[str] = []
    manifest = prepare(config(data_dir, collections["sources"]), log=lines.append).to_json()
    return data_dir, manifest, lines


def shard_records(data_dir: Path, manifest: dict) -> dict[str, list[dict]]:
    from covidxray.data import tfrecord

    return {
        split: list(
            tfrecord.read_records([data_dir / "shards" / s["file"] for s in manifest["shards"] if s["split"] == split])
        )
        for split in ("train", "val", "test")
    }


def test_every_drop_is_counted_per_source_and_reason(collections, prepared):
    data_dir, manifest, lines = prepared
    expected = Counter()
    for name, layout in collections["layouts"].items():
        expected.update({f"{name}: {reason}": n for reason, n in layout.dropped.items()})
        expected.update(f"{name}: {DECODE_REASON[kind]}" for kind in layout.bad_images.values())
    assert manifest["dropped"] == dict(expected)
    assert manifest["dropped_total"] == sum(expected.values())
    with open(data_dir / "dropped.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert Counter(f"{r['source']}: {r['reason']}" for r in rows) == expected
    assert any("corrupt-upload.jpeg" in r["where"] and "not a decodable image" in r["detail"] for r in rows)
    assert any("skipped 2 file(s) (chest-xray-pneumonia: image unreadable)" in line for line in lines)


def test_copies_across_collections_are_removed_in_favour_of_the_original(collections, prepared):
    data_dir, manifest, _ = prepared
    kaggle_good = len(collections["layouts"]["chest-xray-pneumonia"].labels) - len(
        collections["layouts"]["chest-xray-pneumonia"].bad_images
    )
    removed = manifest["duplicates_removed"]
    assert removed["by_source"] == {
        "chest-xray-pneumonia": {"kermany": kaggle_good},
        "covid19-talo": {"covid-chestxray": 3},
    }
    assert (removed["exact"], removed["perceptual"]) == (kaggle_good + 2, 1)
    with open(data_dir / "duplicates.csv", newline="") as handle:
        duplicates = {Path(r["removed_image"]).name: r for r in csv.DictReader(handle)}
    assert duplicates["ieee-reencoded.jpg"]["kind"] == "perceptual"
    assert Path(duplicates["ieee-reencoded.jpg"]["kept_image"]).name == "covid-1-day3.png"
    assert Path(duplicates["ieee-copy-one.jpeg"]["kept_image"]).name == "covid-1-PA.jpeg"
    assert manifest["sources"]["chest-xray-pneumonia"]["records_kept"] == 0


def test_counts_per_split_source_and_class_add_up(collections, prepared):
    data_dir, manifest, _ = prepared
    layouts = collections["layouts"]
    usable = {name: len(layout.labels) - len(layout.bad_images) for name, layout in layouts.items()}
    kept = {
        "kermany": usable["kermany"],
        "covid-chestxray": usable["covid-chestxray"],
        "covid19-talo": usable["covid19-talo"] - 3,
    }
    totals = Counter()
    for _split, info in manifest["splits"].items():
        totals.update(info["sources"])
        assert sum(info["classes"].values()) == info["records"] == sum(info["sources"].values())
        for source, classes in info["source_classes"].items():
            assert sum(classes.values()) == info["sources"][source]
    assert dict(totals) == kept
    shards = shard_records(data_dir, manifest)
    assert {split: len(recs) for split, recs in shards.items()} == {
        s: i["records"] for s, i in manifest["splits"].items()
    }
    assert all(len(recs) > 0 for recs in shards.values())
    labels = manifest["labels"]
    in_shards = Counter(labels[r["label"]] for recs in shards.values() for r in recs)
    expected = Counter({"normal": 0, "pneumonia": 0, "covid-19": 0})
    for name, layout in layouts.items():
        for file, label in layout.labels.items():
            if file not in layout.bad_images and name != "chest-xray-pneumonia" and not file.startswith("ieee-"):
                expected["covid-19" if label == "covid-19" else "normal" if label == "normal" else "pneumonia"] += 1
    assert in_shards == expected


def test_no_patient_is_in_two_splits(prepared):
    data_dir, manifest, _ = prepared
    shards = shard_records(data_dir, manifest)
    patients = {split: {r["patient_id"] for r in recs} for split, recs in shards.items()}
    assert (
        not (patients["train"] & patients["val"])
        and not (patients["train"] & patients["test"])
        and not (patients["val"] & patients["test"])
    )
    assert manifest["patient_disjoint"] is True
    with open(data_dir / "splits.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == sum(len(r) for r in shards.values())
    split_of: dict[str, set] = {}
    for row in table:
        split_of.setdefault(row["patient_id"], set()).add(row["split"])
    assert all(len(s) == 1 for s in split_of.values())
    assert manifest["duplicates_removed"]["patients_merged"] >= 3  # the copies' patient ids joined the originals'


def test_rerun_is_idempotent_and_a_killed_run_resumes_to_identical_shards(collections, prepared, tmp_path, monkeypatch):
    _, reference, _ = prepared
    sources = collections["sources"]
    data_dir = tmp_path / "data"
    decodes = Counter()
    real_decode = image_cache.decode_one

    def counting_decode(job):
        decodes[job[0]] += 1
        return real_decode(job)

    monkeypatch.setattr(image_cache, "decode_one", counting_decode)

    class Kill(KeyboardInterrupt):
        pass

    seen = {"totals": [], "done": 0}

    def kill_mid_shards(done, total=None):
        if total is not None:
            seen["totals"].append(total)  # first the decode total, then decode + shard records
        seen["done"] += done
        if len(seen["totals"]) == 2 and seen["done"] > seen["totals"][0] + 13:
            raise Kill  # in the third shard of six records each

    with pytest.raises(Kill):
        prepare(config(data_dir, sources), progress=kill_mid_shards)
    first_decodes = sum(decodes.values())
    assert any(p.suffix == ".tfrecord" for p in (data_dir / "shards").iterdir())
    assert not (data_dir / "manifest.json").exists()

    resumed = prepare(config(data_dir, sources)).to_json()
    assert sum(decodes.values()) == first_decodes  # nothing decoded twice
    assert 0 < resumed["shards_reused"] < len(resumed["shards"])
    assert resumed["shards"] == reference["shards"]  # same files, same bytes as an uninterrupted run

    again = prepare(config(data_dir, sources)).to_json()
    assert again["shards_reused"] == len(again["shards"]) and again["shards"] == reference["shards"]

    changed = Path(sources["covid-chestxray"]["from_path"]) / "images" / "2c35005f.jpg"
    original = changed.read_bytes()
    try:
        write_image(changed, seed=424242)
        updated = prepare(config(data_dir, sources)).to_json()
        assert sum(decodes.values()) == first_decodes + 1  # only the changed file
        changed_shards = [
            a["file"] for a, b in zip(updated["shards"], reference["shards"]) if a["sha256"] != b["sha256"]
        ]
        assert len(changed_shards) == 1
    finally:
        changed.write_bytes(original)


def test_chest4_keeps_only_known_causes_and_oct_is_its_own_task(collections, tmp_path):
    sources = {k: collections["sources"][k] for k in ("covid-chestxray", "covid19-talo")}
    # every image in train: the fixture has a single bacterial image, which a val or test split would take from train
    manifest = prepare(
        config(tmp_path / "chest4", sources, task="chest4", val_fraction=0.0, test_fraction=0.0)
    ).to_json()
    assert manifest["labels"] == ["normal", "bacterial", "viral", "covid-19"]
    assert manifest["dropped"]["covid19-talo: label 'pneumonia' not in task chest4"] == 4
    assert manifest["dropped"]["covid-chestxray: label 'pneumonia/fungal' not in task chest4"] == 1
    totals = Counter()
    for info in manifest["splits"].values():
        totals.update(info["classes"])
    assert totals["bacterial"] == 1 and totals["viral"] == 2 and totals["covid-19"] > 0

    _, oct_ = build_mendeley_v3(tmp_path / "v3")
    manifest = prepare(
        config(
            tmp_path / "oct",
            {"kermany": {"from_path": str(oct_.root), "part": "oct"}},
            task="oct",
            workers=2,
            val_fraction=0.0,  # a handful of patients: any val or test split would leave a class without training images
            test_fraction=0.0,
        )
    ).to_json()
    assert manifest["labels"] == ["cnv", "dme", "drusen", "normal"]
    assert sum(i["records"] for i in manifest["splits"].values()) == len(oct_.labels)


def test_a_task_without_matching_images_says_what_was_dropped(collections, tmp_path):
    with pytest.raises(UserError, match=r"no usable records for task oct.*not in task oct"):
        prepare(config(tmp_path / "d", {"covid19-talo": collections["sources"]["covid19-talo"]}, task="oct"))


def test_bad_archive_and_wrong_checksum_stop_with_an_actionable_error(tmp_path):
    broken = tmp_path / "COVID-19-master.zip"
    broken.write_bytes(b"PK\x03\x04" + bytes(200))
    result = run_cli(
        "prepare",
        "--source",
        "covid19-talo",
        "--from",
        str(broken),
        "--data-dir",
        str(tmp_path / "d"),
        env={"COLUMNS": "400"},
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{broken} is not a readable zip or tar archive" in result.stderr and "download again" in result.stderr
    build_talo(tmp_path / "talo")
    archive = zip_tree(tmp_path / "talo", tmp_path / "talo.zip")
    with pytest.raises(UserError, match="checksum mismatch.*expected sha256 c{64}"):
        prepare(config(tmp_path / "d2", {"covid19-talo": {"from_path": str(archive), "sha256": "c" * 64}}))


def test_cli_prepares_the_real_talo_sample(shared_data, tmp_path):
    data_dir = tmp_path / "talo"
    result = run_cli(
        "prepare",
        "--source",
        "covid19-talo",
        "--from",
        str(shared_data / "covid19-talo-sample"),
        "--data-dir",
        str(data_dir),
        "--image-size",
        "64",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    manifest = json.loads((data_dir / "manifest.json").read_text())
    assert sum(i["records"] for i in manifest["splits"].values()) == 24
    assert f"wrote {len(manifest['shards'])} shards" in result.stderr
    for split in ("train", "val", "test"):
        assert split in result.stderr


def test_perceptual_threshold_is_validated(tmp_path):
    with pytest.raises(UserError, match="dedup_max_distance"):
        prepare(config(tmp_path, {"synthetic": {"patients": 4}}, dedup_max_distance=64))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_decode_workers_reuse_freed_image_buffers(tmp_path):
    """Without it every 1024 px decode maps and page-faults fresh memory (~15% of decode time)."""
    rng = np.random.default_rng(0)
    for n in range(6):
        cv2.imwrite(str(tmp_path / f"{n}.png"), rng.integers(0, 256, (1024, 1024), dtype=np.uint8))
    probe = f"""
import resource
from covidxray.data.decode_pool import keep_freed_buffers
from covidxray.data.image_cache import DEFAULT_MAX_PIXELS, decode_one
paths = [{", ".join(repr(str(tmp_path / f"{n}.png")) for n in range(6))}]
def faults_per_decode():
    decode_one((paths[0], 64, DEFAULT_MAX_PIXELS))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for path in paths:
        decode_one((path, 64, DEFAULT_MAX_PIXELS))
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / len(paths)
default = faults_per_decode()
print(default, keep_freed_buffers(), faults_per_decode())
"""
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout.split()
    default, applied, kept = float(out[0]), out[1], float(out[2])
    assert applied == "True"
    assert default > 100  # a 1 MB image is 256 pages
    assert kept < default / 10


def test_unmapped_findings_are_listed_with_config_lines_that_map_them(collections, prepared, tmp_path):
    """Issue 15: the printed YAML and --set lines, with the user's label put in, really map the finding."""
    import shlex

    import yaml

    from covidxray.config import parse_override
    from covidxray.data.labels import get_task
    from covidxray.data.prepare import collect_records

    _, _, lines = prepared
    assert any(line.split() == ["1", "x", "'Atelectasis'"] for line in lines)  # the fixture's one unknown finding
    yaml_line = next(line for line in lines if "label_overrides:" in line)
    set_line = next(line for line in lines if "--set " in line)
    from_yaml = yaml.safe_load(yaml_line.split("under data:", 1)[1].replace("LABEL", "pneumonia/other"))
    (argument,) = shlex.split(set_line.split("--set ", 1)[1].replace("LABEL", "pneumonia/other"))
    from_set = parse_override(argument)
    assert from_set == {"data": from_yaml} == {"data": {"label_overrides": {"Atelectasis": "pneumonia/other"}}}
    ieee = {"covid-chestxray": collections["sources"]["covid-chestxray"]}
    cfg = load_config(None, [{"data": {"sources": ieee}}, from_set])
    collected = collect_records(cfg.data, get_task("chest3"), tmp_path)
    assert {r.label for r in collected.records if r.image.name == "atelectasis-1.jpg"} == {"pneumonia/other"}
    assert not any("Atelectasis" in d.reason for _, d in collected.dropped)
