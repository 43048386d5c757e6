"""Classification metrics in plain numpy, shared by validation during training and `covidxray evaluate`.

One implementation means the val AUC that picks the best model is the very
number the evaluation report shows. Conventions follow scikit-learn (the
tests check against it): a score >= threshold is a positive call, undefined
ratios (0/0) are None rather than a made-up 0 or 1.
"""

from __future__ import annotations

import numpy as np


def roc_curve(is_positive: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """False/true positive rates at every distinct score, highest first; thresholds[0] is +inf (nothing called positive)."""
    is_positive = np.asarray(is_positive, dtype=bool)
    scores = np.asarray(scores, dtype=np.float64)
    order = np.argsort(-scores, kind="mergesort")
    scores, is_positive = scores[order], is_positive[order]
    last_of_each_score = np.r_[np.flatnonzero(np.diff(scores)), scores.size - 1]
    tps = np.cumsum(is_positive)[last_of_each_score]
    fps = (last_of_each_score + 1) - tps
    positives, negatives = is_positive.sum(), (~is_positive).sum()
    tpr = np.r_[0.0, tps / positives] if positives else np.full(tps.size + 1, np.nan)
    fpr = np.r_[0.0, fps / negatives] if negatives else np.full(fps.size + 1, np.nan)
    return fpr, tpr, np.r_[np.inf, scores[last_of_each_score]]


def roc_auc(is_positive: np.ndarray, scores: np.ndarray) -> float | None:
    """Area under the ROC curve (ties count half); None when the split lacks positives or negatives."""
    is_positive = np.asarray(is_positive, dtype=bool)
    if is_positive.all() or not is_positive.any():
        return None
    fpr, tpr, _ = roc_curve(is_positive, scores)
    return float(np.trapz(tpr, fpr))


def youden_threshold(is_positive: np.ndarray, scores: np.ndarray) -> float | None:
    """The score threshold maximising sensitivity + specificity - 1 (Youden's J)."""
    fpr, tpr, thresholds = roc_curve(is_positive, scores)
    if np.isnan(fpr).any() or np.isnan(tpr).any():
        return None
    best = 1 + int(np.argmax((tpr - fpr)[1:]))  # index 0 (+inf) calls nothing positive
    return float(thresholds[best])


def confusion_matrix(true: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """Rows: true class, columns: predicted class."""
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (np.asarray(true, dtype=np.int64), np.asarray(predicted, dtype=np.int64)), 1)
    return matrix


def _ratio(numerator: int, denominator: int) -> float | None:
    return float(numerator / denominator) if denominator else None


def binary_rates(is_positive: np.ndarray, called_positive: np.ndarray) -> dict:
    is_positive, called_positive = np.asarray(is_positive, dtype=bool), np.asarray(called_positive, dtype=bool)
    tp = int((is_positive & called_positive).sum())
    fp = int((~is_positive & called_positive).sum())
    fn = int((is_positive & ~called_positive).sum())
    tn = int((~is_positive & ~called_positive).sum())
    return {
        "sensitivity": _ratio(tp, tp + fn),
        "specificity": _ratio(tn, tn + fp),
        "ppv": _ratio(tp, tp + fp),
        "tp": tp,
        "fp": fp,
        "fn": fn,
        "tn": tn,
    }


def macro_auc(labels: np.ndarray, probabilities: np.ndarray) -> float | None:
    """Mean one-vs-rest AUC over the classes that have both positives and negatives here."""
    aucs = [roc_auc(labels == c, probabilities[:, c]) for c in range(probabilities.shape[1])]
    defined = [a for a in aucs if a is not None]
    return float(np.mean(defined)) if defined else None


def cross_entropy(labels: np.ndarray, probabilities: np.ndarray) -> float:
    picked = probabilities[np.arange(len(labels)), labels]
    return float(-np.mean(np.log(np.clip(picked, 1e-7, 1.0))))


def _calibration_bin(confidence: np.ndarray, bins: int) -> np.ndarray:
    """Bin index of each probability for `bins` equal-width bins: bin b holds (b/bins, (b+1)/bins], bin 0 also 0."""
    inner_edges = np.linspace(0.0, 1.0, bins + 1)[1:-1]
    return np.searchsorted(inner_edges, confidence, side="left")


def reliability_bins(labels: np.ndarray, probabilities: np.ndarray, bins: int = 15) -> list[dict]:
    """Per confidence bin: its edges, how many predictions fall in it, their accuracy and mean top-class probability.

    Empty bins are listed with count 0 and accuracy/confidence None, so a diagram shows where no predictions lie.
    """
    labels, probabilities = np.asarray(labels), np.asarray(probabilities, dtype=np.float64)
    confidence = probabilities.max(1)
    correct = probabilities.argmax(1) == labels
    which = _calibration_bin(confidence, bins)
    table = []
    for b in range(bins):
        members = which == b
        count = int(members.sum())
        table.append(
            {
                "low": b / bins,
                "high": (b + 1) / bins,
                "count": count,
                "accuracy": float(correct[members].mean()) if count else None,
                "confidence": float(confidence[members].mean()) if count else None,
            }
        )
    return table


def expected_calibration_error(labels: np.ndarray, probabilities: np.ndarray, bins: int = 15) -> float:
    """Top-class ECE (Guo et al. 2017): sum over equal-width confidence bins of (share of predictions) x |accuracy - mean confidence|.

    `labels` are class indices (N,), `probabilities` rows of class probabilities (N, K); the confidence
    is each row's largest probability, binned into `bins` equal-width bins over (0, 1].
    """
    labels = np.asarray(labels)
    if labels.size == 0:
        raise ValueError("expected calibration error of an empty prediction set")
    table = reliability_bins(labels, probabilities, bins)
    return float(sum(b["count"] * abs(b["accuracy"] - b["confidence"]) for b in table if b["count"]) / labels.size)


def classwise_expected_calibration_error(labels: np.ndarray, probabilities: np.ndarray, bins: int = 15) -> float:
    """Classwise ECE (Kull et al. 2019): per class k, p_k of every image binned like the top-class ECE,
    |share of class k - mean p_k| weighted by bin size; the mean over classes. It also sees miscalibrated
    probabilities of the classes that were not predicted."""
    labels, probabilities = np.asarray(labels), np.asarray(probabilities, dtype=np.float64)
    if labels.size == 0:
        raise ValueError("expected calibration error of an empty prediction set")
    per_class = []
    for c in range(probabilities.shape[1]):
        scores, is_class = probabilities[:, c], labels == c
        which = _calibration_bin(scores, bins)
        gap = sum(
            abs(is_class[which == b].mean() - scores[which == b].mean()) * (which == b).sum() for b in np.unique(which)
        )
        per_class.append(gap / labels.size)
    return float(np.mean(per_class))
