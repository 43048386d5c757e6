"""Issue 2: the whole pipeline on the embedded phantom data, as a user runs it."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from conftest import run_cli


@pytest.mark.slow
def test_demo_runs_every_stage_and_beats_chance(tmp_path):
    result = run_cli("demo", "--workdir", str(tmp_path / "demo"), "--epochs", "10")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "demo" / "run"
    report = json.loads((run_dir / "export_report.json").read_text())
    manifest = json.loads((tmp_path / "demo" / "data" / "manifest.json").read_text())
    test = manifest["splits"]["test"]
    majority = max(test["classes"].values()) / test["records"]
    assert report["float32"]["accuracy"] >= majority + 0.25, (report, majority)
    # predict ran on one held-out image per class through the exported model (an answer, or a reason for none)
    answered = re.findall(r": true (\S+), (?:predicted|no class)", result.stderr)
    assert sorted(answered) == sorted(manifest["labels"]), result.stderr[-3000:]
    # and ended with the run's report, whose path it printed (tests/test_report.py checks its content)
    page = run_dir / "report.html"
    assert f"report: {page}" in " ".join(result.stderr.split()), result.stderr[-3000:]
    assert all(f'<section id="{s}">' in page.read_text() for s in ("data-card", "evaluation", "intended-use"))
    assert (run_dir / "evaluation.json").is_file() and (run_dir / "tensorboard").is_dir()


def test_manifest_describes_the_shards(synthetic_data):
    manifest = json.loads((synthetic_data / "manifest.json").read_text())
    assert manifest["labels"] == ["normal", "pneumonia", "covid-19"]
    assert manifest["image_size"] == 64
    for split, info in manifest["splits"].items():
        files = [s for s in manifest["shards"] if s["split"] == split]
        assert sum(s["records"] for s in files) == info["records"] == sum(info["classes"].values())
        assert all((synthetic_data / "shards" / s["file"]).is_file() for s in files)
    assert manifest["splits"]["train"]["records"] > manifest["splits"]["test"]["records"] > 0
    assert len([s for s in manifest["shards"] if s["split"] == "train"]) >= 2


def test_keras_model_beats_chance_on_held_out_split(trained_run, synthetic_data):
    import tensorflow as tf

    from covidxray.export.tflite import load_split
    from covidxray.manifest import open_prepared

    images, labels = load_split(open_prepared(synthetic_data), "test")
    model = tf.keras.models.load_model(str(trained_run / "model.keras"), compile=False)
    accuracy = float((model.predict(images, verbose=0).argmax(1) == labels).mean())
    majority = np.bincount(labels).max() / len(labels)
    assert accuracy >= majority + 0.25, (accuracy, majority)


def test_tflite_agrees_with_keras_on_test_split(exported_run, synthetic_data):
    import tensorflow as tf

    from covidxray.edge.litert import TFLiteClassifier
    from covidxray.export.tflite import load_split
    from covidxray.manifest import open_prepared

    images, _ = load_split(open_prepared(synthetic_data), "test")
    keras = tf.keras.models.load_model(str(exported_run / "model.keras"), compile=False).predict(images, verbose=0)
    classifier = TFLiteClassifier(exported_run / "model-float32.tflite")
    lite = np.stack(
        [classifier.infer(image)[0] for image in images]
    )  # the model's own output, before the sidecar's temperature
    assert (keras.argmax(1) == lite.argmax(1)).mean() >= 0.98
    np.testing.assert_allclose(keras, lite, atol=1e-3)
    assert (classifier.predict(images).argmax(1) == lite.argmax(1)).all()  # temperature scaling never changes the class


def test_predict_cli_prints_a_class_per_image(exported_run, synthetic_data):
    import csv

    with open(synthetic_data / "splits.csv", newline="") as handle:
        images = [row["image"] for row in csv.DictReader(handle) if row["split"] == "test"][:3]
    result = run_cli("predict", "--model", str(exported_run / "model-float32.tflite"), "--json", *images)
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    assert [item["file"] for item in output] == images
    for item in output:
        assert item["label"] in ("normal", "pneumonia", "covid-19")
        assert abs(sum(item["probabilities"].values()) - 1) < 1e-3
