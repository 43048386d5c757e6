"""Out-of-distribution score: how far an image's embedding lies from the training images'.

The embedding is the input of the model's last Dense layer (the penultimate
features), exported as a second, named output of the .tflite (`embedding`),
so predict gets it from the same LiteRT invocation as the probabilities.
The score is the Mahalanobis distance to the nearest class mean under one
covariance shared by the classes (Lee et al., 2018), estimated from the
train split with Ledoit-Wolf shrinkage: a few thousand images cannot
estimate a 512-1280-dimensional covariance, and the shrunk one is always
invertible. Means and precision matrix travel in the sidecar (float32,
base64), so predict needs numpy only.

The threshold is chosen on the validation split, images the model never
trained on but from the training distribution: the largest validation
distance times `export.ood_margin`. Not a percentile: any percentile below
100 rejects that share of in-distribution radiographs by construction, and
the goal is to reject none; the margin covers radiographs from other
hospitals and scanners, which sit a little further out than the val split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from covidxray.edge.sidecar_arrays import pack, threshold, unpack

METHOD = "Mahalanobis distance to the nearest class mean, shared Ledoit-Wolf covariance (train split)"


@dataclass
class OodModel:
    means: np.ndarray  # (classes, dim)
    precision: np.ndarray  # (dim, dim)
    threshold: float

    def distances(self, embeddings: np.ndarray) -> np.ndarray:
        """Distance of each row of `embeddings` (n, dim) to its nearest class mean."""
        centred = np.asarray(embeddings, dtype=np.float64)[:, None, :] - self.means[None]  # (n, classes, dim)
        squared = np.einsum("ncd,de,nce->nc", centred, self.precision, centred)
        return np.sqrt(np.maximum(squared.min(axis=1), 0.0))

    def to_sidecar(self, extra: dict) -> dict:
        classes, dim = self.means.shape
        return {
            "method": METHOD,
            "classes": classes,
            "dim": dim,
            "threshold": self.threshold,
            **extra,
            "means": pack(self.means),
            "precision": pack(self.precision),
        }

    @classmethod
    def from_sidecar(cls, entry: dict) -> OodModel:
        classes, dim = int(entry["classes"]), int(entry["dim"])
        return cls(
            unpack(entry["means"], (classes, dim)),
            unpack(entry["precision"], (dim, dim)),
            threshold(entry["threshold"]),
        )


def fit(
    train_embeddings: np.ndarray, train_labels: np.ndarray, num_classes: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """Class means, the precision of the shrunk within-class covariance, and the shrinkage used."""
    from sklearn.covariance import LedoitWolf

    embeddings = np.asarray(train_embeddings, dtype=np.float64)
    labels = np.asarray(train_labels)
    present = [c for c in range(num_classes) if (labels == c).any()]
    means = np.stack([embeddings[labels == c].mean(axis=0) for c in present])
    centred = embeddings - means[np.searchsorted(present, labels)]
    estimate = LedoitWolf(assume_centered=True).fit(centred)
    return means, estimate.precision_, float(estimate.shrinkage_)


def threshold_on_val(val_scores: np.ndarray, margin: float) -> tuple[float, dict]:
    """The rejection threshold (the largest val score x margin, see the module docstring) and the val summary."""
    val = np.asarray(val_scores, dtype=np.float64)
    summary = {"median": float(np.median(val)), "p99": float(np.percentile(val, 99)), "max": float(val.max())}
    return float(val.max() * margin), summary


def fit_with_threshold(
    train_embeddings: np.ndarray, train_labels: np.ndarray, val_embeddings: np.ndarray, num_classes: int, margin: float
) -> dict:
    """Fit on train, choose the threshold on val; the sidecar entry."""
    means, precision, shrinkage = fit(train_embeddings, train_labels, num_classes)
    model = OodModel(means, precision, threshold=0.0)
    val = model.distances(val_embeddings)
    model.threshold, summary = threshold_on_val(val, margin)
    return model.to_sidecar(
        {
            "margin": margin,
            "shrinkage": shrinkage,
            "train_images": int(len(train_labels)),
            "val_images": int(len(val)),
            "val_distance": summary,
        }
    )
