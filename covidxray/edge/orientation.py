"""Is the film upright? An inverted (negative) or upside-down film is refused, never classified.

Training shows the model only upright films with bone bright, so the class it
gives a film shown inverted (MONOCHROME1 pixels tagged MONOCHROME2, a negative
scanned as a positive) or turned 180 degrees is arbitrary: the round-3
reliability report saw an NIH normal film become pneumonia 0.90 inverted and
a Kaggle normal film pneumonia 0.83 upside down. A film turned 90 degrees
already fails the chest-layout score; these two do not, since their coarse
layout is as film-like as the original's.

The check is a four-way logistic regression over the model input shrunk to
SIDE x SIDE pixels and standardised per image (exposure and contrast do not
count): upright, inverted, upside down, both. At export it is fitted on the
train films in all four orientations, each also re-framed and with a random
gamma (films from other hospitals are exposed and processed differently), with
scikit-learn; predict needs its weights and numpy only. An image is refused
when upright has a probability below MIN_UPRIGHT_PROBABILITY, with the most
probable other orientation as the reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import cv2
import numpy as np

from covidxray.edge.chest_layout import reframe
from covidxray.edge.sidecar_arrays import pack, unpack

VERSION = 1
SIDE = 24  # the layout at 12 px leaves upright and upside-down too alike; at 24 px the shoulders and diaphragm tell
ORIENTATIONS = ("upright", "inverted", "upside-down", "inverted-upside-down")
SEED = 0
# Not the argmax: 14 of the 20 (of 7,116) real upright films the regression takes for odd still get 0.1 or more
# for upright, while films really shown odd (67 of 68 in scripts/bench_gate.py) and most gray photos get less.
# The upright probability, not the best other one: a photo split between two odd views (`china`: 0.90
# upside-down, upright 1e-13) is no upright film either. At 0.1: 6 false refusals, 36 of 49 gray photos refused
# (0.9 on the best other orientation: the same 6, 26 photos, 65 odd films). Figures of the first small_cnn run's
# fit, 2026-12-05.
MIN_UPRIGHT_PROBABILITY = 0.1
# Every train film of a usual split, not a stride over it. Fitted on every 3rd train film of bench_gate's two runs
# (4,129 and 4,406 films), 12 to 27 of the 7,116 real films there were refused, depending on which 3rd and on the
# seed, and 37 to 112 of their 21,336 turned copies passed; fitted on every film, 5 to 7 and 23 to 32
# (docs/deploy.md). Stronger L2 (C=0.03) refuses 0-3 films but lets 3-4 times as many turned copies through.
# Memory: ~80 MB a 1,000 films (12 views each at 24 px: their list, the array, its standardised copy), +360 MB
# at 4,406.
MAX_FILMS = 5000
GAMMA_RANGE = (0.5, 2.0)
METHOD = f"4-way logistic regression on the standardised {SIDE} px model input (scikit-learn, L2, C=1)"


def views(image: np.ndarray) -> list[np.ndarray]:
    """The image in each of ORIENTATIONS' order, as if it were upright: turning it that way gives the others."""
    gray = np.asarray(image, np.float32).reshape(image.shape[:2])
    turned = gray[::-1, ::-1]
    return [gray, 255 - gray, turned, 255 - turned]


def vectors(images: Iterable[np.ndarray]) -> np.ndarray:
    """Model inputs -> (n, SIDE * SIDE) float32, each row mean 0, variance 1."""
    small = np.array(
        [
            cv2.resize(np.asarray(i, np.float32).reshape(i.shape[:2]), (SIDE, SIDE), interpolation=cv2.INTER_AREA)
            for i in images
        ],
        np.float32,
    ).reshape(-1, SIDE * SIDE)
    centred = small - small.mean(axis=1, keepdims=True)
    return centred / (centred.std(axis=1, keepdims=True) + 1e-6)


@dataclass
class OrientationModel:
    coef: np.ndarray  # (len(ORIENTATIONS), SIDE * SIDE)
    intercept: np.ndarray  # (len(ORIENTATIONS),)

    def probabilities(self, images: Iterable[np.ndarray]) -> np.ndarray:
        """(n, len(ORIENTATIONS)): how probable each orientation is for each model input."""
        logits = vectors(images).astype(np.float64) @ self.coef.T + self.intercept
        logits -= logits.max(axis=1, keepdims=True)
        odds = np.exp(logits)
        return odds / odds.sum(axis=1, keepdims=True)

    def orientation(self, image: np.ndarray) -> tuple[str, float, float]:
        """(the orientation found, its probability, the probability of upright): upright unless upright has a
        probability below MIN_UPRIGHT_PROBABILITY, else the most probable other orientation."""
        probabilities = self.probabilities([image])[0]
        if probabilities[0] >= MIN_UPRIGHT_PROBABILITY:
            return ORIENTATIONS[0], float(probabilities[0]), float(probabilities[0])
        odd = 1 + int(probabilities[1:].argmax())
        return ORIENTATIONS[odd], float(probabilities[odd]), float(probabilities[0])

    def to_sidecar(self, extra: dict) -> dict:
        return {
            "version": VERSION,
            "method": METHOD,
            "side": SIDE,
            "orientations": list(ORIENTATIONS),
            **extra,
            "coef": pack(self.coef),
            "intercept": pack(self.intercept),
        }

    @classmethod
    def from_sidecar(cls, entry: dict) -> OrientationModel:
        """ValueError for an entry of another version or size, KeyError/TypeError/ValueError when damaged."""
        if entry["version"] != VERSION or entry["side"] != SIDE or entry["orientations"] != list(ORIENTATIONS):
            raise ValueError(
                f"version {entry['version']!r} at {entry['side']!r} px, this predictor has version {VERSION} at {SIDE} px"
            )
        count = len(ORIENTATIONS)
        return cls(unpack(entry["coef"], (count, SIDE * SIDE)), unpack(entry["intercept"], (count,)))


def _training_views(train_images: Iterable[np.ndarray], rng: np.random.Generator):
    for image in train_images:
        framed = reframe(image, rng)
        exposed = 255 * (reframe(image, rng) / 255.0) ** np.exp(rng.uniform(*np.log(GAMMA_RANGE)))
        for base in (image, framed, exposed):
            yield from views(base)


def fit_entry(train_images: Iterable[np.ndarray], val_images: Iterable[np.ndarray]) -> dict:
    """Fit on the train films in the four orientations; the sidecar entry `orientation`, with how the val films fare."""
    from sklearn.linear_model import LogisticRegression

    x = vectors(_training_views(train_images, np.random.default_rng(SEED)))
    y = np.tile(np.arange(len(ORIENTATIONS)), len(x) // len(ORIENTATIONS))
    fitted = LogisticRegression(C=1.0, max_iter=3000).fit(x, y)
    model = OrientationModel(fitted.coef_, fitted.intercept_)
    val = model.probabilities(list(val_images))
    return model.to_sidecar(
        {
            "train_images": len(x) // (3 * len(ORIENTATIONS)),
            "val_images": len(val),
            "val_upright_probability": {"min": float(val[:, 0].min()), "median": float(np.median(val[:, 0]))},
            # real films it would refuse: should be 0
            "val_not_upright": int((val[:, 0] < MIN_UPRIGHT_PROBABILITY).sum()),
        }
    )
