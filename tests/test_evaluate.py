"""Issue 4: evaluation metrics (checked against scikit-learn) and `covidxray evaluate`."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from sklearn import metrics as sk

from conftest import run_cli
from covidxray.train import metrics
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
    assert metrics.macro_auc(labels, probs) == pytest.approx(sk.roc_auc_score(labels, probs, multi_class="ovr", average="macro"))


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
    np.testing.assert_array_equal(metrics.confusion_matrix(labels, predicted, 3), sk.confusion_matrix(labels, predicted, labels=[0, 1, 2]))
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
    assert report["thresholds"]["chosen_on"] == "val" and report["thresholds"]["val_images"] == manifest["splits"]["val"]["records"]
    assert report["data_is_training_data"] is True
    for name in manifest["labels"]:
        entry = report["per_class"][name]
        assert 0.5 < entry["roc_auc"] <= 1.0  # the session model learned the phantom findings
        assert entry["operating_point"]["threshold"] == report["thresholds"]["per_class"][name]
    for plot in ("roc.png", "confusion.png"):
        assert (run_dir / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "macro ROC AUC" in result.stderr


def test_evaluate_sees_what_keras_sees_on_the_test_split(evaluated_run, synthetic_data):
    """Same pixels as the export/predict path: accuracy recomputed from the shards' plain reader."""
    import tensorflow as tf

    from covidxray.export.tflite import load_split

    run_dir, _ = evaluated_run
    images, labels = load_split(synthetic_data, "test")
    predicted = tf.keras.models.load_model(str(run_dir / "model.keras"), compile=False).predict(images, verbose=0).argmax(1)
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
