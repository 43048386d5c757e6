"""scripts/diagnose_test_shift.py's two questions, on features whose answer is known by construction."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
diagnose_test_shift = pytest.importorskip("diagnose_test_shift")

LABELS = ["normal", "pneumonia"]


def synthetic_splits(test_normal_offset: float, seed: int = 0) -> dict:
    """Two classes apart along feature 0; the test split's normal images moved along feature 1 by the offset.

    Every image is its own patient except pairs in train, so the folds by patient have groups to keep together.
    """
    rng = np.random.default_rng(seed)
    splits = {}
    for split, n in (("train", 400), ("val", 100), ("test", 200)):
        labels = np.repeat([0, 1], n // 2)
        features = rng.normal(size=(n, 8))
        features[:, 0] += 3.0 * labels
        if split == "test":
            features[labels == 0, 1] += test_normal_offset
        patients = np.array([f"{split}-{i // 2 if split == 'train' else i}" for i in range(n)])
        splits[split] = {
            "features": features,
            "pixels": np.c_[features[:, 1], rng.normal(size=(n, 4))],
            "labels": labels,
            "patients": patients,
        }
    return splits


def test_a_shift_in_one_class_of_the_test_split_is_found_in_that_class_only():
    shift = diagnose_test_shift.test_split_shift(synthetic_splits(test_normal_offset=3.0), LABELS)
    assert shift["normal"]["auc"] > 0.9
    assert 0.35 < shift["pneumonia"]["auc"] < 0.65  # the same distribution: chance, within the sampling spread
    assert shift["normal"]["test_images"] == 100 and shift["normal"]["train_val_images"] == 250
    # the first pixel statistic carries the shift (feature 1), the others are noise
    assert shift["normal"]["pixel_statistic_auc"]["mean"] > 0.9
    assert shift["pneumonia"]["pixel_statistic_auc"]["mean"] < 0.65


def test_the_linear_probe_reaches_the_bayes_figures_of_two_gaussian_classes():
    """Unit-variance classes 3 apart along one feature: the best ranking has AUC Phi(3 / sqrt 2) and the best
    balanced threshold, halfway, finds each class with probability Phi(1.5)."""
    from scipy.stats import norm

    probe = diagnose_test_shift.linear_probe(synthetic_splits(test_normal_offset=0.0), LABELS)
    assert probe["C"] in diagnose_test_shift.PROBE_C
    assert probe["test_auc"] == pytest.approx(norm.cdf(3 / np.sqrt(2)), abs=0.03)
    for name in LABELS:
        assert probe["test_sensitivity"][name] == pytest.approx(norm.cdf(1.5), abs=0.07)
    assert probe["test_accuracy"] == pytest.approx(norm.cdf(1.5), abs=0.05)


def test_a_train_subset_is_a_seeded_draw_without_replacement():
    train = synthetic_splits(test_normal_offset=0.0)["train"]
    first, again, other = (diagnose_test_shift.subset(train, 50, seed) for seed in (0, 0, 1))
    rows = {tuple(row) for row in train["features"]}
    assert len({tuple(row) for row in first["features"]}) == 50 and {tuple(r) for r in first["features"]} <= rows
    assert np.array_equal(first["features"], again["features"]) and not np.array_equal(
        first["features"], other["features"]
    )
    assert all(len(values) == 50 for values in first.values())  # every field drawn alike: labels stay with images
    picked = {tuple(row): label for row, label in zip(first["features"], first["labels"])}
    assert all(
        picked[tuple(row)] == label for row, label in zip(train["features"], train["labels"]) if tuple(row) in picked
    )
