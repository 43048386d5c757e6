"""Issue 12 part 3 and issue 14: temperature scaling and the out-of-distribution score, against independent oracles."""

from __future__ import annotations

import numpy as np
import pytest

from covidxray.edge import ood
from covidxray.edge.calibration import apply_temperature
from covidxray.export.calibration import LOG_T_BOUNDS, calibration_summary, fit_temperature
from covidxray.train.metrics import expected_calibration_error


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def ece_oracle(labels, probabilities, bins=15) -> float:
    """Guo et al. 2017, eq. 3, written out with a loop over samples."""
    n = len(labels)
    sums = np.zeros((bins, 3))  # count, correct, confidence
    for label, row in zip(labels, probabilities):
        confidence = row.max()
        b = min(bins - 1, max(0, int(np.ceil(confidence * bins)) - 1))
        sums[b] += (1, row.argmax() == label, confidence)
    return sum(c / n * abs(k / c - conf / c) for c, k, conf in sums if c)


def overconfident_set(seed: int, n: int, temperature: float):
    """Labels drawn from softmax(z); the 'model' reports softmax(z * temperature), i.e. too sure when temperature > 1."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 1.5, (n, 3))
    truth = softmax(logits)
    labels = np.array([rng.choice(3, p=p) for p in truth])
    return softmax(logits * temperature), labels


def test_fitted_temperature_recovers_the_known_one():
    for known in (0.5, 2.5):
        reported, labels = overconfident_set(0, 20000, known)
        assert fit_temperature(reported, labels, floor=1e-7) == pytest.approx(known, rel=0.05)


def test_temperature_scaling_lowers_ece_on_held_out_overconfident_predictions():
    fit_on, fit_labels = overconfident_set(1, 3000, 3.0)
    held_out, labels = overconfident_set(2, 3000, 3.0)
    temperature = fit_temperature(fit_on, fit_labels, floor=1e-7)
    before, after = ece_oracle(labels, held_out), ece_oracle(labels, apply_temperature(held_out, temperature, 1e-7))
    assert before > 0.1 and after < before / 3
    assert expected_calibration_error(labels, held_out) == pytest.approx(before)


def test_a_perfectly_separated_val_split_is_reported_at_the_search_bound():
    """Every argmax right: the NLL keeps falling as T -> 0, so there is no finite optimum to report as one."""
    reported, labels = overconfident_set(4, 500, 0.5)
    separated = reported.copy()
    separated[np.arange(len(labels)), labels] += 1.0  # the labelled class now always wins
    separated /= separated.sum(axis=1, keepdims=True)
    summary = calibration_summary(separated, labels, floor=1e-7)
    assert summary["at_search_bound"] and summary["value"] == pytest.approx(np.exp(LOG_T_BOUNDS[0]), rel=1e-3)
    assert not calibration_summary(reported, labels, floor=1e-7)["at_search_bound"]  # an ordinary set: inside


def test_temperature_keeps_the_class_and_one_is_the_identity():
    reported, _ = overconfident_set(3, 200, 2.0)
    np.testing.assert_allclose(apply_temperature(reported, 1.0, 1e-12), reported, rtol=1e-9)
    for t in (0.3, 4.0):
        scaled = apply_temperature(reported, t, 1e-7)
        assert (scaled.argmax(1) == reported.argmax(1)).all()
        np.testing.assert_allclose(scaled.sum(1), 1.0)
        # the formula on logits: softmax(log p / T)
        np.testing.assert_allclose(scaled, softmax(np.log(reported) / t), rtol=1e-6)


def test_int8_zeros_stay_finite():
    reported = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]])
    scaled = apply_temperature(reported, 2.0, floor=1 / 512)
    assert np.isfinite(scaled).all() and (scaled > 0).all() and (scaled.argmax(1) == [0, 0]).all()


def gaussian_classes(rng, n_per_class: int, dim: int = 32):
    """Three classes sharing an elongated covariance: variance 25 along the first 4 axes, 0.04 along the rest."""
    scales = np.r_[np.full(4, 5.0), np.full(dim - 4, 0.2)]
    means = rng.normal(0, 3, (3, dim)) * (scales > 1)  # class means differ only in the high-variance directions
    points = np.concatenate([means[c] + rng.normal(0, 1, (n_per_class, dim)) * scales for c in range(3)])
    return points, np.repeat(np.arange(3), n_per_class), means, scales


def test_mahalanobis_score_catches_what_euclidean_distance_misses():
    rng = np.random.default_rng(0)
    train, labels, means, scales = gaussian_classes(rng, 400)
    val, _, _, _ = gaussian_classes(np.random.default_rng(1), 200)
    entry = ood.fit_with_threshold(train, labels, val, 3, margin=1.2)
    model = ood.OodModel.from_sidecar(entry)
    # in-distribution images it never saw: none rejected
    fresh = means[1] + np.random.default_rng(2).normal(0, 1, (500, train.shape[1])) * scales
    assert (model.distances(fresh) <= model.threshold).all()
    # off-manifold: a 3-unit step along a low-variance axis, a smaller Euclidean move than the classes' own spread
    off = fresh.copy()
    off[:, 10] += 3.0
    assert np.linalg.norm(off - fresh, axis=1).max() < np.linalg.norm(fresh - means[1], axis=1).mean()
    assert (model.distances(off) > model.threshold).all()


def test_distances_match_scipy_for_the_stored_precision():
    from scipy.spatial.distance import mahalanobis

    rng = np.random.default_rng(3)
    train, labels, _, _ = gaussian_classes(rng, 100, dim=8)
    entry = ood.fit_with_threshold(train, labels, train[:50], 3, margin=1.0)
    model = ood.OodModel.from_sidecar(entry)
    points = rng.normal(0, 4, (20, 8))
    expected = [min(mahalanobis(p, m, model.precision) for m in model.means) for p in points]
    np.testing.assert_allclose(model.distances(points), expected, rtol=1e-9)
    # the threshold is the largest val distance times the margin
    assert model.threshold == pytest.approx(model.distances(train[:50]).max(), rel=1e-6)


def test_shrunk_covariance_is_ledoit_wolf():
    from sklearn.covariance import ledoit_wolf

    rng = np.random.default_rng(4)
    train, labels, _, _ = gaussian_classes(
        rng, 20, dim=64
    )  # fewer images than dimensions: the sample covariance is singular
    means, precision, shrinkage = ood.fit(train, labels, 3)
    centred = train - means[labels]
    expected, expected_shrinkage = ledoit_wolf(centred, assume_centered=True)
    assert 0 < shrinkage < 1 and shrinkage == pytest.approx(expected_shrinkage)
    np.testing.assert_allclose(np.linalg.inv(precision), expected, rtol=1e-6, atol=1e-9)
