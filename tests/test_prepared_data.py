"""The prepared data set travels as one PreparedData per command; the artifacts between stages load strictly."""

from __future__ import annotations

import builtins
import hashlib
import json
import pathlib
import re
import shutil
from pathlib import Path

import pytest

from covidxray.config import load_config
from covidxray.errors import UserError
from covidxray.manifest import MANIFEST, check_model_matches, open_prepared, seal
from covidxray.run_folder import MODEL_CARD, read_model_card


def dataset_id_of(manifest: dict) -> str:
    """The data set's id by its definition: sha256 of sorted compact JSON of what training reads."""
    identity = {k: manifest[k] for k in ("task", "labels", "image_size", "preprocessing", "shards")}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@pytest.fixture
def count_manifest_reads(monkeypatch) -> list[str]:
    """Every opening or reading of a file named manifest.json from here on, by any path through Python's file API."""
    reads: list[str] = []
    real_open, real_read_bytes, real_read_text = builtins.open, pathlib.Path.read_bytes, pathlib.Path.read_text

    def counted(path) -> None:
        if Path(str(path)).name == MANIFEST:
            reads.append(str(path))

    def open_(file, *args, **kwargs):
        if isinstance(file, (str, Path)):
            counted(file)
        return real_open(file, *args, **kwargs)

    def read_bytes(self):
        counted(self)
        return real_read_bytes(self)

    def read_text(self, *args, **kwargs):
        counted(self)
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(pathlib.Path, "read_bytes", read_bytes)
    monkeypatch.setattr(pathlib.Path, "read_text", read_text)
    return reads


@pytest.mark.slow
def test_train_evaluate_and_export_each_read_the_manifest_once(
    synthetic_data, tmp_path, count_manifest_reads, monkeypatch
):
    from covidxray.export.tflite import export
    from covidxray.train import distributed
    from covidxray.train.evaluate import evaluate
    from covidxray.train.trainer import train

    # TensorFlow fixes its thread pools at its first use, which in the whole suite's process was an earlier test
    monkeypatch.setattr(distributed, "configure_threads", lambda local_size: None)

    run_dir = tmp_path / "run"
    config = load_config(
        None, [{"data": {"data_dir": str(synthetic_data)}, "train": {"run_dir": str(run_dir), "epochs": 1}}]
    )
    said: list[str] = []
    train(config, say=said.append)
    assert len(count_manifest_reads) == 1, count_manifest_reads
    # the prepared set decides (64 px): the config says so, keeps its own value, and the card records the set's
    assert config.data.image_size == 128
    assert any("data.image_size 128 in the config, 64 in" in line for line in said)
    manifest = json.loads((synthetic_data / MANIFEST).read_text())
    card = json.loads((run_dir / MODEL_CARD).read_text())
    assert (card["image_size"], card["task"], card["dataset_id"]) == (64, "chest3", dataset_id_of(manifest))
    inputs = json.loads((run_dir / "run_inputs.json").read_text())
    assert inputs["dataset_id"] == dataset_id_of(manifest)
    assert inputs["data"] == {"task": "chest3", "image_size": 64, "harmonise": manifest["harmonise"]}

    count_manifest_reads.clear()
    evaluate(config, say=lambda _: None)
    assert len(count_manifest_reads) == 1, count_manifest_reads
    count_manifest_reads.clear()
    config.export.formats = ["float32"]
    report = export(config, say=lambda _: None)
    assert len(count_manifest_reads) == 1, count_manifest_reads
    assert report["dataset_id"] == dataset_id_of(manifest) and report["data_is_training_data"] is True

    # evaluate --external: one reading of the training set (also for the copy check) and one of the external set
    from covidxray.data.prepare import prepare

    external_dir = tmp_path / "external"
    external = {"sources": {"synthetic": {"patients": 60, "seed": 1}}, "data_dir": str(external_dir), "image_size": 64}
    prepare(load_config(None, [{"data": external}]).data)
    count_manifest_reads.clear()
    evaluated = evaluate(config, say=lambda _: None, externals=[str(external_dir)])
    assert sorted(map(Path, count_manifest_reads)) == sorted([synthetic_data / MANIFEST, external_dir / MANIFEST])
    assert evaluated.external[0].data_dir == str(external_dir)


def test_the_data_set_id_is_the_recorded_content_hash(synthetic_data):
    manifest = json.loads((synthetic_data / MANIFEST).read_text())
    data = open_prepared(synthetic_data)
    assert data.dataset_id == dataset_id_of(manifest)
    assert data.manifest.to_json() == manifest  # every field of a manifest prepare wrote is typed, none lost
    assert data.shards("val") == [
        synthetic_data / "shards" / s["file"] for s in manifest["shards"] if s["split"] == "val" and s["records"]
    ]


def test_a_manifest_of_another_version_is_refused_and_one_without_a_version_is_version_1(synthetic_data, tmp_path):
    content = json.loads((synthetic_data / MANIFEST).read_text())
    del content["checksum"]
    data_dir = tmp_path / "data"
    shutil.copytree(synthetic_data, data_dir)
    (data_dir / MANIFEST).write_text(json.dumps(seal({**content, "format": "covidxray-shards/2"})))
    with pytest.raises(UserError, match=r"format 'covidxray-shards/2', written by another version of covidxray"):
        open_prepared(data_dir)
    unversioned = {k: v for k, v in content.items() if k != "format"}
    (data_dir / MANIFEST).write_text(json.dumps(seal(unversioned)))
    assert open_prepared(data_dir).manifest.format == "covidxray-shards/1"


def test_an_old_model_card_still_loads_and_names_its_data_by_the_manifest_bytes(trained_run, synthetic_data, tmp_path):
    """A card written before `version` and `dataset_id`: the sha256 of manifest.json's bytes named its data."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(trained_run / "model.keras", run_dir / "model.keras")
    card = json.loads((trained_run / MODEL_CARD).read_text())
    old = {k: v for k, v in card.items() if k not in ("version", "dataset_id")}
    old["manifest_sha256"] = hashlib.sha256((synthetic_data / MANIFEST).read_bytes()).hexdigest()
    (run_dir / MODEL_CARD).write_text(json.dumps(old))
    loaded = read_model_card(run_dir)
    assert loaded.version == 1 and loaded.dataset_id is None
    assert check_model_matches(loaded, open_prepared(synthetic_data)) is True
    (run_dir / MODEL_CARD).write_text(json.dumps({**old, "manifest_sha256": "0" * 64}))
    assert check_model_matches(read_model_card(run_dir), open_prepared(synthetic_data)) is False

    (run_dir / MODEL_CARD).write_text(json.dumps({**card, "version": 2}))
    with pytest.raises(UserError, match=r"model card of version 2, written by another version of covidxray"):
        read_model_card(run_dir)
    (run_dir / MODEL_CARD).write_text(json.dumps({**card, "image_size": "large"}))
    with pytest.raises(UserError, match=r"model.json is damaged \(.*image_size: expected int"):
        read_model_card(run_dir)
    (run_dir / MODEL_CARD).write_text(json.dumps({**card, "extra": 1}))
    with pytest.raises(UserError, match=r"model.json is damaged \(.*unknown key\(s\) extra"):
        read_model_card(run_dir)


def test_a_run_recorded_before_dataset_id_still_resumes(synthetic_data, tmp_path):
    """run_inputs.json of an earlier covidxray names the data set `data_sha256`: the same id."""
    from covidxray.train.distributed import World
    from covidxray.train.run_guard import RUN_INPUTS, check_before_training, training_settings

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = load_config(None, [{"data": {"data_dir": str(synthetic_data)}, "train": {"run_dir": str(run_dir)}}])
    manifest = json.loads((synthetic_data / MANIFEST).read_text())
    old = {"data_sha256": dataset_id_of(manifest), "data_dir": str(synthetic_data), "train": training_settings(config)}
    (run_dir / RUN_INPUTS).write_text(json.dumps(old))
    with check_before_training(World(), config, open_prepared(synthetic_data), {}, True, False, print):
        pass
    (run_dir / RUN_INPUTS).write_text(json.dumps({**old, "data_sha256": "0" * 64}))
    with pytest.raises(UserError, match=r"different data set"):
        check_before_training(World(), config, open_prepared(synthetic_data), {}, True, False, print)


def a_sidecar() -> dict:
    return {"labels": ["normal", "pneumonia"], "image_size": 64, "temperature": {"value": 1.5}, "format": "float32"}


def test_the_sidecar_loader_is_strict_and_versioned():
    from covidxray.sidecar import SidecarError, read_sidecar

    loaded = read_sidecar(a_sidecar(), ("labels", "image_size"))
    assert (loaded.labels, loaded.image_size, loaded.temperature_value, loaded.version) == (
        ["normal", "pneumonia"],
        64,
        1.5,
        1,  # exported before the field existed: version 1
    )
    assert loaded.ood is None and loaded.harmonise == "none"
    refusals = {
        "version": ({**a_sidecar(), "version": 2}, "is of version 2, written by another version of covidxray"),
        "missing gate": (a_sidecar(), r"lacks ood, layout, orientation \(without it a check of the input gate"),
        "labels": ({**a_sidecar(), "labels": ["a", "a"]}, "labels must be a list of distinct names"),
        "temperature": ({**a_sidecar(), "temperature": {"value": float("nan")}}, "positive value"),
        "type": ({**a_sidecar(), "keras_sha256": ["x"]}, r"is damaged \(sidecar.keras_sha256: expected text"),
        "unknown": ({**a_sidecar(), "thresholds": {}}, r"is damaged \(sidecar: unknown key\(s\) thresholds"),
    }
    for name, (content, words) in refusals.items():
        required = ("labels", "image_size", "temperature", "ood", "layout", "orientation")
        with pytest.raises(SidecarError, match=words):
            read_sidecar(content, required if name == "missing gate" else ("labels", "image_size"))


def an_evaluation_report() -> dict:
    """evaluation.json as `covidxray evaluate` writes it for a two-class model, by hand (one external set)."""
    rates = {"sensitivity": 0.75, "specificity": None, "ppv": 1.0, "tp": 3, "fp": 0, "fn": 1, "tn": 0}
    per_class = {
        "normal": {"support": 4, "roc_auc": 0.8, "argmax": rates, "operating_point": {"threshold": 0.4, **rates}},
        "pneumonia": {"support": 0, "roc_auc": None, "argmax": rates, "operating_point": None},
    }
    metrics = {
        "images": 4,
        "accuracy": 0.75,
        "macro_roc_auc": 0.8,
        "labels": ["normal", "pneumonia"],
        "confusion_matrix": [[3, 1], [0, 0]],
        "per_class": per_class,
    }
    source = {**metrics, "classes": {"normal": 4, "pneumonia": 0}, "ece": 0.1, "train_images": 9, "unseen": False}
    copy = {"kind": "exact", "evidence": "same pixels", "external_source": "s", "external_image": "a.png"}
    external = {
        **metrics,
        "data_dir": "/data/external",
        "images_prepared": 6,
        "classes": {"normal": 4, "pneumonia": 0},
        "untrained_classes": {},
        "dropped_as_copies": 1,
        "dropped_by_kind": {"exact": 1},
        "dropped_unchecked": 1,
        "copies_table": "external_copies_1.csv",
        "copies": [{**copy, "training_split": "train", "training_image": "b.png"}],
        "dropped_record_ids": ["r1", "r2"],
        "ece": 0.2,
        "per_source": {"s": source},
    }
    bins = [{"low": 0.0, "high": 0.5, "count": 0, "accuracy": None, "confidence": None}]
    return {
        **metrics,
        "calibration": {"ece": 0.1, "classwise_ece": 0.05, "bins": 1, "binning": "words", "reliability": bins},
        "per_source": {"s": source},
        "split": "test",
        "thresholds": {"chosen_on": "val", "rule": "Youden J", "val_images": 5, "per_class": {"normal": 0.4}},
        "model": {"file": "/run/model.keras", "architecture": "small_cnn", "best_epoch": 3},
        "data_dir": "/data/training",
        "data_is_training_data": True,
        "external": [external],
    }


def an_export_report() -> dict:
    """export_report.json as `covidxray export` writes it for float32 and int8, by hand."""
    entry = {
        "file": "model-float32.tflite",
        "agreement": 1.0,
        "accuracy": 0.9,
        "accuracy_delta": 0.0,
        "temperature": 1.2,
        "val_ece_before_after": [0.1, 0.05],
        "ood_threshold": 7.5,
        "test_over_ood_threshold": 0.01,
        "layout_threshold": 3.0,
        "test_over_layout_threshold": 0.0,
        "test_not_upright": 0.0,
        "bytes": 123456,
    }
    return {
        "keras": {"file": "model.keras", "bytes": 200000, "accuracy": 0.9},
        "saved_model": "saved_model",
        "test_images": 50,
        "dataset_id": "ab" * 32,
        "data_is_training_data": True,
        "int8_min_agreement": 0.97,
        "float32": entry,
        "int8": {**entry, "file": "model-int8.tflite", "meets_bar": True, "c_array": ["model_int8.cc", "model_int8.h"]},
    }


def test_the_evaluation_and_export_reports_load_strictly_and_round_trip(tmp_path):
    from covidxray.reports import (
        read_evaluation_report,
        read_export_report,
        write_evaluation_report,
        write_export_report,
    )

    cases = [
        ("evaluation.json", an_evaluation_report, read_evaluation_report, write_evaluation_report, "an evaluation"),
        ("export_report.json", an_export_report, read_export_report, write_export_report, "an export"),
    ]
    for name, content, read, write, kind in cases:
        written_by_hand = tmp_path / "by-hand"
        written_by_hand.mkdir(exist_ok=True)
        (written_by_hand / name).write_text(json.dumps(content()))  # no version: written before the field existed
        loaded = read(written_by_hand)
        assert loaded.version == 1
        again = tmp_path / "again"
        again.mkdir(exist_ok=True)
        write(again, loaded)
        assert read(again) == loaded
        # what is written is what the command wrote before the version field, and the version
        assert json.loads((again / name).read_text()) == {**content(), "version": 1}

        (written_by_hand / name).write_text(json.dumps({**content(), "version": 2}))
        words = re.escape(f"{written_by_hand / name} is {kind} report of version 2, written by another version of")
        with pytest.raises(UserError, match=words):
            read(written_by_hand)
    path = tmp_path / "by-hand" / "evaluation.json"
    wrong = an_evaluation_report()
    wrong["per_class"]["normal"]["support"] = "four"
    path.write_text(json.dumps(wrong))
    with pytest.raises(UserError, match=re.escape(f"{path} is damaged ({path}.per_class.normal.support: expected int")):
        read_evaluation_report(path.parent)
    path.write_text(json.dumps({**an_evaluation_report(), "data_is_training_data": "perhaps"}))
    with pytest.raises(UserError, match=r"evaluation\.json\.data_is_training_data: expected true/false"):
        read_evaluation_report(path.parent)
    path = tmp_path / "by-hand" / "export_report.json"
    wrong = an_export_report()
    wrong["int8"]["agreement"] = "high"
    path.write_text(json.dumps(wrong))
    with pytest.raises(UserError, match=re.escape(f"{path} is damaged ({path}.int8.agreement: expected float")):
        read_export_report(path.parent)
    path.write_text(json.dumps({**an_export_report(), "test_images": [50]}))
    with pytest.raises(UserError, match=r"export_report\.json\.test_images: expected int"):
        read_export_report(path.parent)
    path.write_text(json.dumps({**an_export_report(), "float16": 3}))
    with pytest.raises(UserError, match=r"export_report\.json\.float16: expected a format's entry"):
        read_export_report(path.parent)
