"""Issue 24: `covidxray evaluate --external`: copies of training images are dropped before scoring, the rest scored."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import SHARED_DATA, run_cli
from sklearn import metrics as sk

from covidxray.errors import UserError
from covidxray.manifest import Manifest
from covidxray.run_folder import ModelCard
from covidxray.train.external import check_fits

KAGGLE_PER_CLASS = 6  # real pediatric films of the Kaggle test folder: the external set's genuine images
PLANTED = {  # external file name -> how it copies a training film
    "IM-9001-0001.png": "exact",
    "IM-9002-0001.jpeg": "cropped",
    "person9003_bacteria_1.jpeg": "re-encoded",
}


def _plant(original: Path, target: Path, how: str) -> None:
    gray = cv2.imread(str(original), cv2.IMREAD_GRAYSCALE)
    if how == "exact":
        shutil.copy(original, target)
    elif how == "cropped":  # 9% off every side, as a republisher trims a film's border and markers
        h, w = gray.shape
        cv2.imwrite(
            str(target),
            gray[h * 9 // 100 : h * 91 // 100, w * 9 // 100 : w * 91 // 100],
            [cv2.IMWRITE_JPEG_QUALITY, 95],
        )
    else:  # downscaled and re-encoded at a low JPEG quality
        small = cv2.resize(gray, (700, 700), interpolation=cv2.INTER_AREA)
        cv2.imwrite(str(target), small, [cv2.IMWRITE_JPEG_QUALITY, 60])


@pytest.fixture(scope="module")
def external_run(tmp_path_factory):
    """A small_cnn trained on the talo sample (64 px), and a Kaggle-layout external set with three planted copies."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data not present")
    root = tmp_path_factory.mktemp("external")
    training_dir, run_dir = root / "training", root / "run"
    result = run_cli(
        "prepare",
        "--source",
        f"covid19-talo={SHARED_DATA / 'covid19-talo-sample'}",
        "--image-size",
        "64",
        "--data-dir",
        str(training_dir),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(training_dir / "splits.csv", newline="") as handle:
        trained = [row for row in csv.DictReader(handle) if row["split"] in ("train", "val")]
    normals = [Path(r["image"]) for r in trained if r["class"] == "normal"]
    pneumonias = [Path(r["image"]) for r in trained if r["class"] == "pneumonia"]
    sources = {
        "IM-9001-0001.png": normals[0],
        "IM-9002-0001.jpeg": normals[1],
        "person9003_bacteria_1.jpeg": pneumonias[0],
    }

    kaggle = root / "kaggle" / "chest_xray" / "test"
    for folder in ("NORMAL", "PNEUMONIA"):
        (kaggle / folder).mkdir(parents=True)
        for image in sorted((SHARED_DATA / "chest-xray-pneumonia-224" / "chest_xray" / "test" / folder).iterdir())[
            :KAGGLE_PER_CLASS
        ]:
            shutil.copy(image, kaggle / folder / image.name)
    for name, how in PLANTED.items():
        _plant(sources[name], kaggle / ("PNEUMONIA" if "bacteria" in name else "NORMAL") / name, how)
    external_dir = root / "external"
    result = run_cli(
        "prepare",
        "--source",
        f"chest-xray-pneumonia={root / 'kaggle'}",
        "--image-size",
        "64",
        "--data-dir",
        str(external_dir),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli(
        "train",
        "--data-dir",
        str(training_dir),
        "--run-dir",
        str(run_dir),
        "--epochs",
        "2",
        "--set",
        "train.batch_size=8",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli(
        "evaluate", "--run-dir", str(run_dir), "--data-dir", str(training_dir), "--external", str(external_dir)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, external_dir, result


@pytest.mark.slow
def test_planted_copies_are_dropped_counted_and_listed(external_run):
    run_dir, external_dir, result = external_run
    (external,) = json.loads((run_dir / "evaluation.json").read_text())["external"]
    manifest = json.loads((external_dir / "manifest.json").read_text())
    prepared = sum(manifest["splits"][s]["records"] for s in ("train", "val", "test"))
    assert prepared == 2 * KAGGLE_PER_CLASS + len(PLANTED)
    assert external["images_prepared"] == prepared and external["images"] == 2 * KAGGLE_PER_CLASS
    assert external["dropped_as_copies"] == len(PLANTED) and external["dropped_unchecked"] == 0
    dropped = {Path(c["external_image"]).name: c for c in external["copies"]}
    assert set(dropped) == set(PLANTED)
    assert dropped["IM-9001-0001.png"]["kind"] == "exact"
    assert (
        dropped["IM-9002-0001.jpeg"]["kind"] == "geometric"
    )  # the crop moves every low frequency: the keypoints find it
    assert dropped["person9003_bacteria_1.jpeg"]["kind"] == "perceptual"
    assert all(c["training_split"] in ("train", "val") for c in dropped.values())
    with open(run_dir / external["copies_table"], newline="") as handle:
        assert {Path(row["external_image"]).name for row in csv.DictReader(handle)} == set(PLANTED)
    assert f"dropped {len(PLANTED)} as copies" in result.stderr
    assert external["classes"] == {"normal": KAGGLE_PER_CLASS, "pneumonia": KAGGLE_PER_CLASS, "covid-19": 0}


@pytest.mark.slow
def test_external_metrics_equal_sklearn_on_the_images_left(external_run):
    import tensorflow as tf

    from covidxray.data.tfrecord import read_records
    from covidxray.manifest import open_prepared

    run_dir, external_dir, _ = external_run
    (external,) = json.loads((run_dir / "evaluation.json").read_text())["external"]
    records = [
        r
        for split in ("train", "val", "test")
        for r in read_records(open_prepared(external_dir).shards(split))
        if not any(f":{name}:" in r["record_id"] for name in PLANTED)
    ]
    labels = np.array([r["label"] for r in records])
    model = tf.keras.models.load_model(str(run_dir / "model.keras"), compile=False)
    probs = model.predict(np.stack([r["image"] for r in records]).astype(np.float32), verbose=0)
    predicted = probs.argmax(1)
    assert external["images"] == labels.size == 2 * KAGGLE_PER_CLASS
    assert external["accuracy"] == pytest.approx(sk.accuracy_score(labels, predicted))
    aucs = [sk.roc_auc_score(labels == c, probs[:, c]) for c in (0, 1)]  # no covid-19 image: its AUC is undefined
    assert external["macro_roc_auc"] == pytest.approx(np.mean(aucs), abs=1e-6)
    assert external["per_class"]["covid-19"]["roc_auc"] is None
    for c, name in enumerate(("normal", "pneumonia")):
        rates = external["per_class"][name]["argmax"]
        assert external["per_class"][name]["roc_auc"] == pytest.approx(aucs[c], abs=1e-6)
        assert rates["sensitivity"] == pytest.approx(sk.recall_score(labels == c, predicted == c))
        assert rates["specificity"] == pytest.approx(sk.recall_score(labels != c, predicted != c))
    assert external["per_class"]["covid-19"]["argmax"]["specificity"] == pytest.approx(np.mean(predicted != 2))


def test_an_external_set_that_does_not_fit_the_model_is_refused_by_name():
    fields = {"task": "chest3", "labels": ["normal", "pneumonia", "covid-19"], "image_size": 64, "preprocessing": 1}
    card = ModelCard(**fields)

    def manifest(**changed) -> Manifest:
        return Manifest(**{**fields, "image_size": 128, "harmonise": "none", **changed})

    with pytest.raises(UserError, match=r"image_size is 128, the model's 64.*--image-size 64"):
        check_fits(card, manifest(), Path("ext"))
    with pytest.raises(UserError, match="labels"):
        check_fits(card, manifest(image_size=64, task="pneumonia", labels=["normal", "pneumonia"]), Path("e"))
    with pytest.raises(UserError, match="harmonise is 'trim-inpaint-equalise', the model's 'none'"):
        check_fits(card, manifest(image_size=64, harmonise="trim-inpaint-equalise"), Path("e"))
    check_fits(card, manifest(image_size=64), Path("e"))  # fits: no error


@pytest.mark.slow
def test_the_training_data_as_external_set_is_refused(external_run):
    run_dir, _, _ = external_run
    training_dir = run_dir.parent / "training"
    result = run_cli(
        "evaluate", "--run-dir", str(run_dir), "--data-dir", str(training_dir), "--external", str(training_dir)
    )
    assert result.returncode == 2 and "is the training data set itself" in result.stderr
    assert "Traceback" not in result.stderr
