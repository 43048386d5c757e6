"""Is this decoded image plausibly a chest radiograph? Cheap checks, before any model runs.

`prepare` drops what fails (counted as `image not-radiograph`) and `predict`
answers `rejected: not a chest radiograph` instead of a class. These checks
catch what needs no model: thumbnails too small to read, blank or
near-constant images, strips and banners, binary-looking images (documents,
screenshots, drawings), noise, and gradients with no grain at all. Photos,
CT slices and other body parts look like images and pass here; predict leaves
those to the model's out-of-distribution score (covidxray/edge/ood.py) and the
chest-layout score (covidxray/edge/chest_layout.py).

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
GATE_VERSION = 4


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
# Version 3 adds the 9 px scale, for what passed all of the above in scripts/bench_gate.py (gray
# photos of textures, micrographs, a scanned page, 64 px MR slices, noise smoothed over 2 or 8 px):
# radiographs' detail at 9 px <= 0.0515 (limit 0.07; those images 0.078-0.15), and its ratio to the
# 3 px detail <= 3.97 (limit 7: blobs with no fine grain, noise smoothed over 5-16 px 7.3-9.2; a
# radiograph shrunk to 96 px and blown up to 512 px reaches 6.9, below it).
# Version 4 adds `framed`, for a film shown inside a window or page (a PACS screenshot: the round-3 report's
# N1, pneumonia 0.94 where the film alone gets normal): on both sides, left and right or top and bottom, a band
# of lines at least 90% of one flat background level (+-3). Real films reach 0.172 of the width (an ieee8023
# figure with black side bars; 5,993 films + 523 NIH + 602 ieee8023 768 px), viewer screenshots 0.15-0.26;
# the limit 0.2 is only 1.16 x the real maximum (a letterboxed film squashed to the square model input is
# distorted anyway), and viewers that fill the window more than that still pass.
# Checked in this order; the first failing one is the reason given.
CHECKS = (
    Check("too-small", 64, True, "short side in pixels"),
    Check("extreme-aspect", 3.0, False, "long side over short side"),
    Check("near-uniform", 24.0, True, "gray-level spread (1st to 99th percentile)"),
    Check("text-or-noise", 0.06, False, "fine detail relative to the gray-level spread"),
    Check("too-smooth", 0.002, True, "fine detail relative to the gray-level spread"),
    Check("few-gray-levels", 0.6, False, "share of pixels on the two most common gray levels"),
    Check("busy-texture", 0.07, False, "detail at 9 px relative to the gray-level spread"),
    Check("grainless-blobs", 7.0, False, "detail at 9 px over detail at 3 px"),
    Check("framed", 0.2, False, "share of the width or height in flat bands on both sides (a window or page)"),
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


def percentiles_of_histogram(counts: np.ndarray, percents: tuple[float, ...]) -> np.ndarray:
    """`np.percentile(values, percents)`, bit for bit, from the histogram of at least one integer value
    (`counts[v]`: how many values are v): the same linear interpolation between the same two order statistics,
    found in the cumulative counts instead of by partitioning the values (0.02 ms instead of 0.33 for a thumbnail).
    """
    cumulative = np.cumsum(counts)
    last = int(cumulative[-1]) - 1
    position = last * (np.asarray(percents, np.float64) / 100)  # numpy's virtual index, (n - 1) * q
    # numpy takes the last value for both neighbours at or past the last index; any weight then gives that value
    below = np.minimum(np.floor(position), last)
    lower = np.searchsorted(cumulative, below, side="right")  # the value of order statistic `below`
    upper = np.searchsorted(cumulative, np.minimum(below + 1, last), side="right")
    weight = position - below
    difference = upper - lower
    # numpy's _lerp: from the nearer end, so that a weight of 1 gives the upper value exactly
    return np.where(weight >= 0.5, upper - difference * (1 - weight), lower + difference * weight)


def _detail(small: np.ndarray, side: int) -> float:
    return float(np.abs(small.astype(np.float32) - cv2.blur(small, (side, side)).astype(np.float32)).mean())


def _framed(small: np.ndarray) -> float:
    """The narrower of the two flat bands (left/right, or top/bottom: the larger pair) as a share of that side.

    A band line is one whose pixels are at least 90% within 3 gray levels of the background, the commonest
    level along the image's edge; overlay text in a viewer's corners leaves its lines at that share.
    """
    edge = np.concatenate([small[0], small[-1], small[:, 0], small[:, -1]])
    background = int(np.bincount(edge, minlength=256).argmax())
    flat = np.abs(small.astype(np.int16) - background) <= 3

    def run(lines: np.ndarray) -> int:
        full = lines >= 0.9
        return len(full) if full.all() else int(np.argmin(full))

    columns, rows = flat.mean(axis=0), flat.mean(axis=1)
    sideways = min(run(columns), run(columns[::-1])) / small.shape[1]
    upright = min(run(rows), run(rows[::-1])) / small.shape[0]
    return float(max(sideways, upright))


def features(gray: np.ndarray) -> dict[str, float]:
    """The value each check in CHECKS looks at, keyed by its reason."""
    height, width = gray.shape[:2]
    small = _thumbnail(gray)
    counts = np.bincount(small.ravel(), minlength=256)
    low, high = percentiles_of_histogram(counts, (1, 99))
    spread = float(high - low)
    top_two = float(np.sort(counts)[-2:].sum() / small.size)
    # Detail at a scale: mean absolute difference from a box blur of that size, relative to the spread
    # so that contrast does not matter. Radiographs are smooth at 3 px; text strokes, UI edges and noise
    # are not. At 9 px, anatomy is still smoother than textures, print and small MR slices.
    detail, texture = (_detail(small, side) / max(spread, 1.0) for side in (3, 9))
    return {
        "too-small": float(min(height, width)),
        "near-uniform": spread,
        "extreme-aspect": max(height, width) / max(1, min(height, width)),
        "few-gray-levels": top_two,
        "text-or-noise": detail,
        "too-smooth": detail,  # the same measure, from below: gradients and blurred blobs have no grain at all
        "busy-texture": texture,
        "grainless-blobs": texture / max(detail, 1e-6),
        "framed": _framed(small),
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
