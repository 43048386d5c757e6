"""Issue 4: evaluation metrics (checked against scikit-learn) and `covidxray evaluate`."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import run_cli
from sklearn import metrics as sk

from covidxray.manifest import Manifest, SplitSummary
from covidxray.train import metrics
from covidxray.train.by_source import per_source_report, unseen_sources
from covidxray.train.evaluate import choose_thresholds, classification_report


@pytest.fixture(scope="module")
def predictions():
    """A fixed 3-class prediction set with tied scores, a weak and a strong class."""
    rng = np.random.default_rng(7)
    labels = rng.integers(0, 3, 300)
    logits = np.round(rng.normal(size=(300, 3)) + np.eye(3)[labels] * np.array([0.6, 1.5, 3.0]), 1)  # coarse: many ties
    return labels, np.exp(logits) / np.exp(logits).sum(1, keepdims=True)


def test_roc_auc_and_curve_match_sklearn(predictions):
    labels, probs = predictions
    for c in range(3):
        fpr, tpr, thresholds = metrics.roc_curve(labels == c, probs[:, c])
        sk_fpr, sk_tpr, sk_thresholds = sk.roc_curve(labels == c, probs[:, c], drop_intermediate=False)
        np.testing.assert_allclose(fpr, sk_fpr)
        np.testing.assert_allclose(tpr, sk_tpr)
        np.testing.assert_allclose(thresholds[1:], sk_thresholds[1:])
        assert metrics.roc_auc(labels == c, probs[:, c]) == pytest.approx(sk.roc_auc_score(labels == c, probs[:, c]))
    assert metrics.macro_auc(labels, probs) == pytest.approx(
        sk.roc_auc_score(labels, probs, multi_class="ovr", average="macro")
    )


def test_heavily_tied_scores_count_ties_half_as_sklearn_does():
    rng = np.random.default_rng(3)
    truth = rng.random(400) < 0.3
    scores = np.clip(rng.integers(0, 5, 400) + truth, 0, 4) / 4  # five distinct values only
    assert metrics.roc_auc(truth, scores) == pytest.approx(sk.roc_auc_score(truth, scores))
    fpr, tpr, _ = metrics.roc_curve(truth, scores)
    sk_fpr, sk_tpr, _ = sk.roc_curve(truth, scores, drop_intermediate=False)
    np.testing.assert_allclose(fpr, sk_fpr)
    np.testing.assert_allclose(tpr, sk_tpr)


def test_confusion_and_rates_match_sklearn(predictions):
    labels, probs = predictions
    predicted = probs.argmax(1)
    np.testing.assert_array_equal(
        metrics.confusion_matrix(labels, predicted, 3), sk.confusion_matrix(labels, predicted, labels=[0, 1, 2])
    )
    report = classification_report(labels, probs, ["a", "b", "c"], [None, None, None])
    assert report["accuracy"] == pytest.approx(sk.accuracy_score(labels, predicted))
    recall = sk.recall_score(labels, predicted, average=None)
    precision = sk.precision_score(labels, predicted, average=None)
    for c, name in enumerate("abc"):
        rates = report["per_class"][name]["argmax"]
        assert rates["sensitivity"] == pytest.approx(recall[c])
        assert rates["ppv"] == pytest.approx(precision[c])
        assert rates["specificity"] == pytest.approx(sk.recall_score(labels != c, predicted != c))


def test_youden_threshold_maximises_j_on_sklearn_curve(predictions):
    labels, probs = predictions
    thresholds = choose_thresholds(labels, probs)
    for c, threshold in enumerate(thresholds):
        fpr, tpr, sk_thresholds = sk.roc_curve(labels == c, probs[:, c])
        best = np.argmax(tpr - fpr)
        assert threshold == pytest.approx(sk_thresholds[best])
        called = probs[:, c] >= threshold
        j = sk.recall_score(labels == c, called) + sk.recall_score(labels != c, ~called) - 1
        assert j == pytest.approx((tpr - fpr).max())


def test_operating_point_applies_the_given_threshold(predictions):
    labels, probs = predictions
    report = classification_report(labels, probs, ["a", "b", "c"], [0.5, 0.3, None])
    point = report["per_class"]["b"]["operating_point"]
    called = probs[:, 1] >= 0.3
    assert point["threshold"] == 0.3
    assert point["sensitivity"] == pytest.approx(sk.recall_score(labels == 1, called))
    assert point["ppv"] == pytest.approx(sk.precision_score(labels == 1, called))
    assert report["per_class"]["c"]["operating_point"] is None


def test_undefined_metrics_are_none_not_made_up():
    labels = np.array([0, 0, 1, 1])
    probs = np.array([[0.9, 0.1, 0.0], [0.8, 0.2, 0.0], [0.3, 0.7, 0.0], [0.6, 0.4, 0.0]])
    report = classification_report(labels, probs, ["a", "b", "c"], choose_thresholds(labels, probs))
    absent = report["per_class"]["c"]
    assert absent["roc_auc"] is None and absent["argmax"]["sensitivity"] is None and absent["argmax"]["ppv"] is None
    assert choose_thresholds(labels, probs)[2] is None  # no threshold for a class val never saw
    assert report["macro_roc_auc"] == pytest.approx(sk.roc_auc_score(labels == 0, probs[:, 0]))


# Six predictions, two classes, 5 bins with edges 0.2 0.4 0.6 0.8 1.0 (no confidence on an inner edge):
#   bin (0.8, 1]: confidences 0.9 (right), 0.95 (wrong), 1.0 (right): accuracy 2/3, mean 0.95, |gap| 0.28333, 3 images
#   bin (0.6, 0.8]: 0.7 (right), 0.65 (wrong): accuracy 1/2, mean 0.675, |gap| 0.175, 2 images
#   bin (0.4, 0.6]: 0.55 (right): accuracy 1, mean 0.55, |gap| 0.45, 1 image
#   ECE = (3 x 0.28333 + 2 x 0.175 + 1 x 0.45) / 6 = (0.85 + 0.35 + 0.45) / 6 = 0.275
# Classwise, class 0's probabilities 0.9 0.95 0.3 0.65 0.45 1.0 against is-class-0 1 0 0 0 0 1:
#   (0.8, 1]: mean 0.95 vs 2/3 -> 3 x 0.28333 = 0.85; 0.3, 0.65, 0.45 alone in their bins vs 0 -> 0.3 + 0.65 + 0.45
#   = 2.25 / 6 = 0.375; class 1 (probabilities 1 - p0) mirrors it bin by bin: 0.375. Mean 0.375.
HAND_LABELS = np.array([0, 1, 1, 1, 1, 0])
HAND_PROBS = np.array([[0.9, 0.1], [0.95, 0.05], [0.3, 0.7], [0.65, 0.35], [0.45, 0.55], [1.0, 0.0]])


def test_expected_calibration_error_matches_the_hand_computation():
    assert metrics.expected_calibration_error(HAND_LABELS, HAND_PROBS, bins=5) == pytest.approx(0.275)
    assert metrics.classwise_expected_calibration_error(HAND_LABELS, HAND_PROBS, bins=5) == pytest.approx(0.375)
    table = metrics.reliability_bins(HAND_LABELS, HAND_PROBS, bins=5)
    assert [b["count"] for b in table] == [0, 0, 1, 2, 3]  # confidence 1.0 belongs to the last bin
    assert table[4]["accuracy"] == pytest.approx(2 / 3) and table[4]["confidence"] == pytest.approx(0.95)
    assert table[0]["accuracy"] is None and table[0]["high"] == pytest.approx(0.2)


def test_expected_calibration_error_default_is_15_bins():
    # with 15 bins (edges k/15) 0.9 and 0.95 and 1.0 fall in three different bins: (0.867, 0.933], (0.933, 1]
    # holds 0.95 (wrong) and 1.0 (right): |0.5 - 0.975| x 2; 0.9 right: 0.1; 0.7 (0.667, 0.733] right: 0.3;
    # 0.65 (0.6, 0.667] wrong: 0.65; 0.55 (0.533, 0.6] right: 0.45 -> (0.95 + 0.1 + 0.3 + 0.65 + 0.45) / 6
    assert metrics.expected_calibration_error(HAND_LABELS, HAND_PROBS) == pytest.approx(2.45 / 6)


def test_constant_confidence_errs_by_its_gap_to_accuracy():
    labels = np.array([0, 0, 0, 1, 1, 1, 1, 1, 0, 1])
    probs = np.tile([0.2, 0.8], (10, 1))  # always class 1 at 0.8
    assert metrics.expected_calibration_error(labels, probs) == pytest.approx(abs(0.6 - 0.8))  # 6 of 10 are class 1
    labels[[0, 1]] = 1  # 8 of 10 right at confidence 0.8: calibrated
    assert metrics.expected_calibration_error(labels, probs) == pytest.approx(0.0, abs=1e-12)


def _subset_oracle(labels, probs, members, num_classes):
    """scikit-learn's numbers for one source's subset."""
    y, p = labels[members], probs[members]
    predicted = p.argmax(1)
    expected = {"images": int(members.sum()), "accuracy": sk.accuracy_score(y, predicted), "per_class": {}}
    for c in range(num_classes):
        has_both = 0 < (y == c).sum() < y.size
        expected["per_class"][c] = {
            "sensitivity": sk.recall_score(y == c, predicted == c) if (y == c).any() else None,
            "specificity": sk.recall_score(y != c, predicted != c) if (y != c).any() else None,
            "roc_auc": sk.roc_auc_score(y == c, p[:, c]) if has_both else None,
        }
    return expected


def a_manifest(sources: dict[str, dict[str, int]], labels=("a", "b", "c"), **data_config) -> Manifest:
    """A manifest whose splits hold these images per source."""
    splits = {split: SplitSummary(records=sum(counts.values()), sources=counts) for split, counts in sources.items()}
    return Manifest(task="t", labels=list(labels), image_size=64, splits=splits, data_config=data_config)


def test_per_source_metrics_match_sklearn_on_each_subset(predictions):
    labels, probs = predictions
    names = ["a", "b", "c"]
    sources = np.array(["kaggle", "ieee", "talo"], dtype=object)[np.random.default_rng(11).integers(0, 3, labels.size)]
    sources[(sources == "talo") & (labels != 2)] = "ieee"  # talo: one class only, so its AUCs are undefined
    manifest = a_manifest(
        {"train": {"kaggle": 100, "ieee": 40, "talo": 0}, "test": {"kaggle": 1, "ieee": 1, "talo": 1}}, names
    )
    report = per_source_report(
        labels, probs, sources, manifest, lambda y, p: classification_report(y, p, names, [None] * 3)
    )
    assert sorted(report) == ["ieee", "kaggle", "talo"]
    for source, entry in report.items():
        members = sources == source
        expected = _subset_oracle(labels, probs, members, 3)
        assert entry["images"] == expected["images"]
        assert entry["accuracy"] == pytest.approx(expected["accuracy"])
        assert entry["classes"] == {name: int((labels[members] == c).sum()) for c, name in enumerate(names)}
        for c, name in enumerate(names):
            got, want = entry["per_class"][name], expected["per_class"][c]
            for key in ("sensitivity", "specificity"):
                assert got["argmax"][key] == (None if want[key] is None else pytest.approx(want[key]))
            assert got["roc_auc"] == (None if want["roc_auc"] is None else pytest.approx(want["roc_auc"]))
    assert report["talo"]["unseen"] is True and report["talo"]["train_images"] == 0
    assert report["talo"]["macro_roc_auc"] is None
    assert report["kaggle"]["unseen"] is False and report["kaggle"]["train_images"] == 100


def test_unseen_sources_are_the_held_out_one_and_those_without_train_images():
    sources = {"train": {"kaggle": 50, "talo": 0}, "test": {"kaggle": 9, "talo": 3, "ieee": 4}}
    assert unseen_sources(a_manifest(sources)) == {"talo", "ieee"}
    assert unseen_sources(a_manifest(sources, holdout_source="kaggle")) == {"talo", "ieee", "kaggle"}
    assert unseen_sources(a_manifest(sources, holdout_source="")) == {"talo", "ieee"}


@pytest.fixture(scope="module")
def evaluated_run(trained_run, synthetic_data, tmp_path_factory):
    """`covidxray evaluate` on a copy of the session's trained model (the shared run stays untouched)."""
    run_dir = tmp_path_factory.mktemp("evaluate") / "run"
    run_dir.mkdir()
    for name in ("model.keras", "model.json"):
        shutil.copy(trained_run / name, run_dir / name)
    result = run_cli("evaluate", "--run-dir", str(run_dir), "--data-dir", str(synthetic_data))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result


def test_evaluate_writes_report_and_plots(evaluated_run, synthetic_data):
    run_dir, result = evaluated_run
    report = json.loads((run_dir / "evaluation.json").read_text())
    manifest = json.loads((synthetic_data / "manifest.json").read_text())
    test = manifest["splits"]["test"]
    matrix = np.array(report["confusion_matrix"])
    assert report["split"] == "test" and report["images"] == matrix.sum() == test["records"]
    assert matrix.sum(1).tolist() == [test["classes"][c] for c in manifest["labels"]]
    assert report["accuracy"] == pytest.approx(np.trace(matrix) / matrix.sum())
    assert (
        report["thresholds"]["chosen_on"] == "val"
        and report["thresholds"]["val_images"] == manifest["splits"]["val"]["records"]
    )
    assert report["data_is_training_data"] is True
    for name in manifest["labels"]:
        entry = report["per_class"][name]
        assert 0.5 < entry["roc_auc"] <= 1.0  # the session model learned the phantom findings
        assert entry["operating_point"]["threshold"] == report["thresholds"]["per_class"][name]
    for plot in ("roc.png", "confusion.png", "reliability.png"):
        assert (run_dir / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "macro ROC AUC" in result.stderr


def test_evaluate_reports_calibration_and_sources(evaluated_run, synthetic_data):
    import cv2

    run_dir, result = evaluated_run
    report = json.loads((run_dir / "evaluation.json").read_text())
    manifest = json.loads((synthetic_data / "manifest.json").read_text())
    calibration = report["calibration"]
    assert calibration["bins"] == 15 == len(calibration["reliability"])
    assert sum(b["count"] for b in calibration["reliability"]) == report["images"]
    matrix = np.array(report["confusion_matrix"])
    correct = sum(b["count"] * b["accuracy"] for b in calibration["reliability"] if b["count"])
    assert correct == pytest.approx(np.trace(matrix))  # the bins' accuracies add up to the confusion matrix's diagonal
    gaps = sum(b["count"] * abs(b["accuracy"] - b["confidence"]) for b in calibration["reliability"] if b["count"])
    assert calibration["ece"] == pytest.approx(gaps / report["images"])
    diagram = cv2.imread(str(run_dir / "reliability.png"))
    assert (
        diagram is not None and diagram.shape[0] > 300 and diagram.shape[1] > 300 and diagram.std() > 10
    )  # a drawn figure
    ((source, entry),) = report["per_source"].items()  # one source: its report is the overall one
    assert source == "synthetic" and entry["images"] == report["images"] and entry["unseen"] is False
    assert entry["classes"] == manifest["splits"]["test"]["classes"] and entry["accuracy"] == report["accuracy"]
    assert "ECE" in result.stderr and "synthetic" in result.stderr


def test_evaluate_sees_what_keras_sees_on_the_test_split(evaluated_run, synthetic_data):
    """Same pixels as the export/predict path: accuracy recomputed from the shards' plain reader."""
    import tensorflow as tf

    from covidxray.export.tflite import load_split
    from covidxray.manifest import open_prepared

    run_dir, _ = evaluated_run
    images, labels = load_split(open_prepared(synthetic_data), "test")
    predicted = (
        tf.keras.models.load_model(str(run_dir / "model.keras"), compile=False).predict(images, verbose=0).argmax(1)
    )
    report = json.loads((run_dir / "evaluation.json").read_text())
    np.testing.assert_array_equal(sk.confusion_matrix(labels, predicted, labels=[0, 1, 2]), report["confusion_matrix"])


def test_evaluate_refuses_data_of_another_task(trained_run, synthetic_data, tmp_path):
    from covidxray.config import load_config
    from covidxray.errors import UserError
    from covidxray.train.evaluate import evaluate

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    card = json.loads((trained_run / "model.json").read_text())
    (run_dir / "model.json").write_text(json.dumps({**card, "labels": ["normal", "abnormal"]}))
    (run_dir / "model.keras").write_bytes(b"not read: the labels are checked first")
    config = load_config(None, [{"data": {"data_dir": str(synthetic_data)}, "train": {"run_dir": str(run_dir)}}])
    with pytest.raises(UserError, match="labels"):
        evaluate(config)
