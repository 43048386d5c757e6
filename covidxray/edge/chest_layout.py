"""Chest-layout score: does the image, seen from far away, look like the training films?

The out-of-distribution score (covidxray/edge/ood.py) asks the classifier's own
embedding, which a small CNN trained on a few thousand films does not make
discriminative for gray photos (a cat, a clock, the moon and a chest film can
share an embedding). This score knows nothing of the classifier: it looks at
the model input shrunk to SIDE x SIDE pixels, where only the layout is left
(two dark lung fields, the bright mediastinum between them, shoulders,
diaphragm), standardised per image so that exposure and contrast do not
count. Its Mahalanobis distance to the train films' mean, under their
Ledoit-Wolf shrunk covariance, is the score.

The fit sees each train film as it is plus REFRAMINGS seeded re-framings
(zoom 0.85-1.1, shift, rotation up to 8 degrees, mirrored half the time,
border replicated, black or white): films from other hospitals are cropped
tighter or looser than the training set's, and those must pass. The score is
that of the image as it is: an inverted or upside-down film is refused before
this check, by covidxray/edge/orientation.py (version 1 took the smaller of
the image's and its negative's score, and so passed inverted films, which the
model then classified at random).

The threshold, as for the OOD score: the largest score over the val split
times `export.layout_margin`. predict checks it after the OOD score, numpy
and OpenCV only (no TensorFlow).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import cv2
import numpy as np

from covidxray.edge.ood import threshold_on_val
from covidxray.edge.sidecar_arrays import pack, threshold, unpack

# Bump when SIDE, the standardisation or the score changes: a predictor refuses a sidecar of another version.
VERSION = 2
METHOD = "Mahalanobis distance of the standardised 12 px model input to the train films (Ledoit-Wolf)"
SIDE = 12  # pixels across: the layout and nothing finer
REFRAMINGS = 4  # re-framed copies of each train film in the fit
SEED = 0


def gray_plane(image: np.ndarray) -> np.ndarray:
    """A model input, (size, size) or (size, size, 1), as its one gray plane: (size, size) float32."""
    return np.asarray(image, np.float32).reshape(image.shape[:2])


def layout_vectors(images: Iterable[np.ndarray]) -> np.ndarray:
    """Model inputs ((size, size) or (size, size, 1), gray 0..255) -> (n, SIDE * SIDE), each row mean 0, variance 1."""
    small = np.stack(
        [cv2.resize(gray_plane(image), (SIDE, SIDE), interpolation=cv2.INTER_AREA) for image in images]
    ).reshape(-1, SIDE * SIDE)
    centred = small.astype(np.float64) - small.mean(axis=1, keepdims=True)
    return centred / (centred.std(axis=1, keepdims=True) + 1e-6)


class OtherVersion(ValueError):
    """A sidecar entry made by another version of this score."""


@dataclass
class LayoutModel:
    mean: np.ndarray  # (SIDE * SIDE,)
    precision: np.ndarray  # (SIDE * SIDE, SIDE * SIDE)
    threshold: float

    def _distances(self, vectors: np.ndarray) -> np.ndarray:
        centred = vectors - self.mean
        return np.sqrt(np.maximum(np.einsum("nd,de,ne->n", centred, self.precision, centred), 0.0))

    def scores(self, images: Iterable[np.ndarray]) -> np.ndarray:
        """One score per model input: its distance from the train films."""
        return self._distances(layout_vectors(images))

    def score(self, image: np.ndarray) -> float:
        return float(self.scores([image])[0])

    def to_sidecar(self, extra: dict) -> dict:
        return {
            "version": VERSION,
            "method": METHOD,
            "side": SIDE,
            "threshold": self.threshold,
            **extra,
            "mean": pack(self.mean),
            "precision": pack(self.precision),
        }

    @classmethod
    def from_sidecar(cls, entry: dict) -> LayoutModel:
        """Raises OtherVersion for an entry this code does not compute, KeyError/TypeError/ValueError when damaged."""
        if entry["version"] != VERSION or entry["side"] != SIDE:
            raise OtherVersion(
                f"version {entry['version']!r} at {entry['side']!r} px, this predictor computes version {VERSION} at {SIDE} px"
            )
        dim = SIDE * SIDE
        return cls(unpack(entry["mean"], (dim,)), unpack(entry["precision"], (dim, dim)), threshold(entry["threshold"]))


def reframe(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The film framed differently: zoomed 0.85-1.1, shifted up to 5%, rotated up to 8 degrees, mirrored half the time."""
    gray = gray_plane(image)
    height, width = gray.shape
    centre = (width / 2 + rng.uniform(-0.05, 0.05) * width, height / 2 + rng.uniform(-0.05, 0.05) * height)
    matrix = cv2.getRotationMatrix2D(centre, rng.uniform(-8, 8), 1 / rng.uniform(0.85, 1.1))
    if rng.uniform() < 0.5:  # what lies outside the film: more of the same, or a black or white border
        moved = cv2.warpAffine(gray, matrix, (width, height), borderMode=cv2.BORDER_REPLICATE)
    else:
        border = float(rng.choice([0.0, 255.0]))
        moved = cv2.warpAffine(gray, matrix, (width, height), borderMode=cv2.BORDER_CONSTANT, borderValue=border)
    return moved[:, ::-1] if rng.uniform() < 0.5 else moved


def _with_reframings(images: Iterable[np.ndarray]) -> Iterable[np.ndarray]:
    rng = np.random.default_rng(SEED)
    for image in images:
        yield image
        for _ in range(REFRAMINGS):
            yield reframe(image, rng)


def fit(train_images: Iterable[np.ndarray]) -> tuple[np.ndarray, np.ndarray, float, int]:
    """Mean, precision of the shrunk covariance, the shrinkage, and how many train films, from the films and their re-framings."""
    from sklearn.covariance import LedoitWolf

    vectors = layout_vectors(_with_reframings(train_images))
    mean = vectors.mean(axis=0)
    estimate = LedoitWolf(assume_centered=True).fit(vectors - mean)
    return mean, estimate.precision_, float(estimate.shrinkage_), len(vectors) // (1 + REFRAMINGS)


def fit_with_threshold(train_images: Iterable[np.ndarray], val_images: Iterable[np.ndarray], margin: float) -> dict:
    """Fit on train, threshold = largest val score x margin; the sidecar entry `layout`."""
    mean, precision, shrinkage, train_count = fit(train_images)
    model = LayoutModel(mean, precision, threshold=0.0)
    val = model.scores(val_images)
    model.threshold, summary = threshold_on_val(val, margin)
    return model.to_sidecar(
        {
            "margin": margin,
            "shrinkage": shrinkage,
            "reframings": REFRAMINGS,
            "train_images": train_count,
            "val_images": int(len(val)),
            "val_score": summary,
        }
    )
