"""Issue 15: the evidence of source bias in a merged real set (source x class table, shortcut warnings, per-source evaluate)."""

from __future__ import annotations

import csv
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_DATA, run_cli
from sklearn import metrics as sk

from covidxray.config import ConfigError, load_config
from covidxray.data.composition import shortcut_warnings

KAGGLE_PER_FOLDER = 60  # of each chest_xray/{train,test}/{NORMAL,PNEUMONIA}: 240 pediatric images


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """`covidxray prepare` of the three shared real samples at 64 px, the Kaggle one cut to a few hundred images."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data not present")
    root = tmp_path_factory.mktemp("merged")
    kaggle = root / "chest-xray-pneumonia"
    for folder in ("train/NORMAL", "train/PNEUMONIA", "test/NORMAL", "test/PNEUMONIA"):
        target = kaggle / "chest_xray" / folder
        target.mkdir(parents=True)
        for image in sorted((SHARED_DATA / "chest-xray-pneumonia-224" / "chest_xray" / folder).iterdir())[
            :KAGGLE_PER_FOLDER
        ]:
            shutil.copy(image, target / image.name)
    data_dir = root / "data"
    result = run_cli(
        "prepare",
        "--source",
        f"covid-chestxray={SHARED_DATA / 'covid-chestxray-sample'}",
        "--source",
        f"covid19-talo={SHARED_DATA / 'covid19-talo-sample'}",
        "--source",
        f"chest-xray-pneumonia={kaggle}",
        "--data-dir",
        str(data_dir),
        "--image-size",
        "64",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return data_dir, result.stderr


def _counts_from_splits_csv(data_dir: Path) -> Counter:
    with open(data_dir / "splits.csv", newline="") as handle:
        return Counter((row["split"], row["source"], row["class"]) for row in csv.DictReader(handle))


def test_source_class_table_matches_splits_csv(merged):
    data_dir, _ = merged
    manifest = json.loads((data_dir / "manifest.json").read_text())
    counts = _counts_from_splits_csv(data_dir)
    assert {source for _, source, _ in counts} == {"chest-xray-pneumonia", "covid-chestxray", "covid19-talo"}
    for split, info in manifest["splits"].items():
        for source, classes in info["source_classes"].items():
            assert classes == {c: counts[(split, source, c)] for c in manifest["labels"]}, (split, source)
    totals = manifest["composition"]["source_classes"]
    for source, classes in totals.items():
        assert classes == {
            c: sum(n for (_, s, k), n in counts.items() if (s, k) == (source, c)) for c in manifest["labels"]
        }


def test_prepare_prints_the_table_and_warns_of_the_shortcut(merged):
    data_dir, printed = merged
    manifest = json.loads((data_dir / "manifest.json").read_text())
    counts = _counts_from_splits_csv(data_dir)
    rows = {
        tuple(line.split()[:2]): line.split()[2:]
        for line in printed.splitlines()
        if line.split()[:1] in (["train"], ["val"], ["test"])
    }
    for (split, source, cls), n in counts.items():
        assert rows[(split, source)][manifest["labels"].index(cls)] == str(n)
    # independently: the classes where one source gives >= 80% of the images, from splits.csv
    expected = set()
    for cls in manifest["labels"]:
        per_source = Counter()
        for (_, source, k), n in counts.items():
            if k == cls:
                per_source[source] += n
        if per_source and max(per_source.values()) / sum(per_source.values()) >= 0.8:
            expected.add(cls)
    assert expected, "the merged sample should have at least one source-dominated class"
    warned = {w.split("'")[1] for w in manifest["composition"]["warnings"] if w.startswith("class")}
    assert warned == expected
    shortcut_lines = [line for line in printed.splitlines() if line.startswith("shortcut risk")]
    assert len(shortcut_lines) == len(manifest["composition"]["warnings"])
    assert "chest-xray-pneumonia (children aged 1-5" in printed or "covid-chestxray (adults" in printed


def test_shortcut_warnings_follow_the_configured_share():
    classes = ["normal", "pneumonia", "covid-19"]
    totals = {
        "kaggle": {"normal": 70, "pneumonia": 90, "covid-19": 0},
        "ieee": {"normal": 30, "pneumonia": 10, "covid-19": 0},
        "talo": {"normal": 0, "pneumonia": 0, "covid-19": 12},
    }
    at_80 = shortcut_warnings(totals, classes, 0.8)
    assert [w.split("'")[1] for w in at_80] == ["pneumonia", "covid-19", "talo"]  # 90%, 100%; talo: one class only
    at_65 = shortcut_warnings(totals, classes, 0.65)
    assert [w.split("'")[1] for w in at_65] == ["normal", "pneumonia", "covid-19", "talo"]  # 70% now counts
    assert shortcut_warnings({"kaggle": totals["kaggle"]}, classes, 0.8) == []  # one source: nothing to confuse


def test_shortcut_share_is_range_checked():
    assert load_config(None, [{"data": {"shortcut_warning_share": 0.9}}]).data.shortcut_warning_share == 0.9
    with pytest.raises(ConfigError, match="shortcut_warning_share"):
        load_config(None, [{"data": {"shortcut_warning_share": 0.3}}])


@pytest.mark.slow
def test_evaluate_per_source_on_the_real_merge(merged, tmp_path):
    """A short small_cnn on the merge; evaluate's per-source figures equal scikit-learn's on each source's test images."""
    import tensorflow as tf

    from covidxray.data.tfrecord import read_records
    from covidxray.manifest import open_prepared

    data_dir, _ = merged
    run_dir = tmp_path / "run"
    trained = run_cli("train", "--data-dir", str(data_dir), "--run-dir", str(run_dir), "--epochs", "3")
    assert trained.returncode == 0, trained.stderr[-3000:]
    evaluated = run_cli("evaluate", "--data-dir", str(data_dir), "--run-dir", str(run_dir))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    report = json.loads((run_dir / "evaluation.json").read_text())

    records = list(read_records(open_prepared(data_dir).shards("test")))  # the plain reader, not evaluate's pipeline
    model = tf.keras.models.load_model(str(run_dir / "model.keras"), compile=False)
    probs = model.predict(np.stack([r["image"] for r in records]).astype(np.float32), verbose=0)
    labels = np.array([r["label"] for r in records])
    sources = np.array([r["source"] for r in records])
    assert sorted(report["per_source"]) == sorted(set(sources))
    for source, entry in report["per_source"].items():
        y, p = labels[sources == source], probs[sources == source]
        predicted = p.argmax(1)
        assert entry["images"] == y.size and entry["accuracy"] == pytest.approx(sk.accuracy_score(y, predicted))
        for c, name in enumerate(report["labels"]):
            got = entry["per_class"][name]
            assert got["support"] == int((y == c).sum())
            if (y == c).any():
                assert got["argmax"]["sensitivity"] == pytest.approx(sk.recall_score(y == c, predicted == c))
            if (y != c).any():
                assert got["argmax"]["specificity"] == pytest.approx(sk.recall_score(y != c, predicted != c))
            if 0 < (y == c).sum() < y.size:
                assert got["roc_auc"] == pytest.approx(sk.roc_auc_score(y == c, p[:, c]), abs=1e-6)
            else:
                assert got["roc_auc"] is None
        assert entry["unseen"] is False  # every source of this merge is in train
        assert f"{source}:" in evaluated.stderr
    assert "ECE" in evaluated.stderr and (run_dir / "reliability.png").is_file()

    # The hold-out split mode: talo only in test, so it is a source this model never saw.
    held_out = tmp_path / "held-out"
    prepared = run_cli(
        "prepare",
        "--source",
        f"covid-chestxray={SHARED_DATA / 'covid-chestxray-sample'}",
        "--source",
        f"covid19-talo={SHARED_DATA / 'covid19-talo-sample'}",
        "--source",
        f"chest-xray-pneumonia={data_dir.parent / 'chest-xray-pneumonia'}",
        "--hold-out-source",
        "covid19-talo",
        "--data-dir",
        str(held_out),
        "--image-size",
        "64",
    )
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    held_out_run = tmp_path / "held-out-run"
    trained = run_cli("train", "--data-dir", str(held_out), "--run-dir", str(held_out_run), "--epochs", "2")
    assert trained.returncode == 0, trained.stderr[-3000:]
    again = run_cli("evaluate", "--data-dir", str(held_out), "--run-dir", str(held_out_run))
    assert again.returncode == 0, again.stderr[-3000:]
    report = json.loads((held_out_run / "evaluation.json").read_text())
    flags = {s: e["unseen"] for s, e in report["per_source"].items()}
    assert "covid19-talo" in flags
    assert flags == {s: s == "covid19-talo" for s in report["per_source"]}
    assert "covid19-talo (unseen source: not in train, a generalisation figure):" in again.stderr
