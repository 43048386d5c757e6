"""Is this decoded image plausibly a chest radiograph? Cheap checks, before any model runs.

`prepare` drops what fails (counted as `image not-radiograph`) and `predict`
answers `rejected: not a chest radiograph` instead of a class. These checks
catch what needs no model: thumbnails too small to read, blank or
near-constant images, strips and banners, binary-looking images (documents,
screenshots, drawings), noise, and gradients with no grain at all. Photos,
CT slices and other body parts look like images and pass here; the model's
out-of-distribution score (covidxray/edge/ood.py) catches those.

Every limit was set from the features of all real radiographs in the
project's shared sample data (about 6,000, chest-xray-pneumonia, ieee8023,
NIH and DICOM CR/DX) against generated and bundled non-radiographs
(scripts/bench_gate.py prints both); each keeps a wide margin on the
radiograph side, because a false rejection withholds a diagnosis.
No TensorFlow: predict on a Pi imports this.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from covidxray.edge.preprocess import ImageError

# Features are computed on a copy whose long side is THUMBNAIL_SIDE (never upscaled), so the
# cost is the same for a 4000 px CR as for a 224 px JPEG and the texture measure sees one scale.
THUMBNAIL_SIDE = 256

# Change when a limit or a feature changes: it is part of the decode cache's fingerprint.
GATE_VERSION = 2


@dataclass(frozen=True)
class Check:
    """One feature, its limit and which side of it a radiograph lies on."""

    reason: str
    limit: float
    radiographs_above: bool  # True: a value below `limit` rejects; False: a value above it rejects
    what: str

    def rejects(self, value: float) -> bool:
        return value < self.limit if self.radiographs_above else value > self.limit


# Limits, against the real radiographs' extremes (min or max over ~6,000) and the phantoms':
# short side >= 157 px (limit 64: no film that small can be read); aspect <= 2.23, a figure of
# two radiographs side by side (limit 3); spread >= 70 (limit 24); fine detail 0.004 to 0.031
# (limits 0.002 and 0.06); top-two share <= 0.31 (limit 0.6). Rendered text scores 0.10-0.21 on
# fine detail, pixel noise 0.15-0.19, gradients and heavily smoothed noise 0, blank images 0 spread.
# Checked in this order; the first failing one is the reason given.
CHECKS = (
    Check("too-small", 64, True, "short side in pixels"),
    Check("extreme-aspect", 3.0, False, "long side over short side"),
    Check("near-uniform", 24.0, True, "gray-level spread (1st to 99th percentile)"),
    Check("text-or-noise", 0.06, False, "fine detail relative to the gray-level spread"),
    Check("too-smooth", 0.002, True, "fine detail relative to the gray-level spread"),
    Check("few-gray-levels", 0.6, False, "share of pixels on the two most common gray levels"),
)


@dataclass(frozen=True)
class GateResult:
    reason: str = ""  # empty when the image passes
    score: float = 0.0  # the failing feature's value
    limit: float = 0.0
    detail: str = ""

    @property
    def passed(self) -> bool:
        return not self.reason


def _thumbnail(gray: np.ndarray) -> np.ndarray:
    height, width = gray.shape[:2]
    scale = THUMBNAIL_SIDE / max(height, width)
    if scale >= 1:
        return gray
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    return cv2.resize(gray, size, interpolation=cv2.INTER_AREA)


def features(gray: np.ndarray) -> dict[str, float]:
    """The value each check in CHECKS looks at, keyed by its reason."""
    height, width = gray.shape[:2]
    small = _thumbnail(gray)
    low, high = np.percentile(small, (1, 99))
    spread = float(high - low)
    counts = np.bincount(small.ravel(), minlength=256)
    top_two = float(np.sort(counts)[-2:].sum() / small.size)
    # Fine detail: mean absolute difference from a 3x3 box blur. Radiographs are smooth at this
    # scale; text strokes, UI edges and noise are not. Relative to the spread, so contrast does not matter.
    detail = float(
        np.abs(small.astype(np.float32) - cv2.blur(small, (3, 3)).astype(np.float32)).mean() / max(spread, 1.0)
    )
    return {
        "too-small": float(min(height, width)),
        "near-uniform": spread,
        "extreme-aspect": max(height, width) / max(1, min(height, width)),
        "few-gray-levels": top_two,
        "text-or-noise": detail,
        "too-smooth": detail,  # the same measure, from below: gradients and blurred blobs have no grain at all
    }


def check(gray: np.ndarray) -> GateResult:
    """The first check the image fails, or a passing result."""
    values = features(gray)
    for item in CHECKS:
        value = values[item.reason]
        if item.rejects(value):
            side = "below" if item.radiographs_above else "above"
            return GateResult(
                item.reason,
                value,
                item.limit,
                f"not a chest radiograph: {item.what} {value:.3g} is {side} {item.limit:g}",
            )
    return GateResult()


def require_radiograph(gray: np.ndarray, path: Path | str) -> None:
    """For `prepare`: raise ImageError('not-radiograph') when `gray` fails a check."""
    result = check(gray)
    if not result.passed:
        raise ImageError("not-radiograph", path, f"{result.detail} ({result.reason})")
