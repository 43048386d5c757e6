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
        "tp": tp, "fp": fp, "fn": fn, "tn": tn,
    }


def macro_auc(labels: np.ndarray, probabilities: np.ndarray) -> float | None:
    """Mean one-vs-rest AUC over the classes that have both positives and negatives here."""
    aucs = [roc_auc(labels == c, probabilities[:, c]) for c in range(probabilities.shape[1])]
    defined = [a for a in aucs if a is not None]
    return float(np.mean(defined)) if defined else None


def cross_entropy(labels: np.ndarray, probabilities: np.ndarray) -> float:
    picked = probabilities[np.arange(len(labels)), labels]
    return float(-np.mean(np.log(np.clip(picked, 1e-7, 1.0))))
