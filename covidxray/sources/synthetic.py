"""Procedural phantom chest radiographs: the embedded default data set.

It lets every stage run (and be tested) with no download. The classes differ
the way the real findings do, in kind rather than in a give-away pixel:
bacterial pneumonia as one dense lobar consolidation, viral pneumonia as
bilateral perihilar streaks, COVID-19 as faint peripheral patches in both
lungs, normal as clear lungs. Anatomy, exposure, pose and noise vary per
patient and per image, so a model has to learn the findings.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import cv2
import numpy as np

from covidxray.errors import UserError
from covidxray.records import Dropped, Record
from covidxray.sources.base import Fetched, Source, SourceOptions, register_source

LABELS = ("normal", "pneumonia/bacterial", "pneumonia/viral", "covid-19")
_INDEX = "labels.csv"
_DONE = ".complete"


@dataclass
class SyntheticOptions(SourceOptions):
    patients: int = 240
    max_images_per_patient: int = 3
    image_size: int = 256
    seed: int = 0


def _gaussian(size: int, cx: float, cy: float, sx: float, sy: float, angle: float = 0.0) -> np.ndarray:
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float32) / size
    dx, dy = xs - cx, ys - cy
    c, s = np.cos(angle), np.sin(angle)
    u, v = c * dx + s * dy, -s * dx + c * dy
    return np.exp(-0.5 * ((u / sx) ** 2 + (v / sy) ** 2))


def _lung_masks(size: int, anatomy: dict) -> tuple[np.ndarray, np.ndarray]:
    masks = []
    for side in (-1, 1):
        mask = np.zeros((size, size), np.float32)
        centre = (int(size * (0.5 + side * anatomy["lung_dx"])), int(size * anatomy["lung_cy"]))
        axes = (int(size * anatomy["lung_w"]), int(size * anatomy["lung_h"]))
        cv2.ellipse(mask, centre, axes, side * anatomy["lung_tilt"], 0, 360, 1.0, -1)
        masks.append(cv2.GaussianBlur(mask, (0, 0), size * 0.02))
    return masks[0], masks[1]


def _finding(label: str, size: int, lungs: tuple[np.ndarray, np.ndarray], anatomy: dict, rng) -> np.ndarray:
    left, right = lungs
    both = np.maximum(left, right)
    if label == "pneumonia/bacterial":
        side = rng.choice([-1, 1])
        cx = 0.5 + side * anatomy["lung_dx"] * rng.uniform(0.8, 1.1)
        cy = anatomy["lung_cy"] + anatomy["lung_h"] * rng.uniform(0.1, 0.5)
        blob = _gaussian(size, cx, cy, rng.uniform(0.06, 0.09), rng.uniform(0.05, 0.08), rng.uniform(0, np.pi))
        return 95 * rng.uniform(0.7, 1.0) * blob * (left if side < 0 else right)
    if label == "pneumonia/viral":
        streaks = np.zeros((size, size), np.float32)
        for _ in range(rng.integers(10, 16)):
            side = rng.choice([-1, 1])
            x0 = size * (0.5 + side * 0.07)
            y0 = size * (anatomy["lung_cy"] + rng.uniform(-0.1, 0.12))
            angle = rng.uniform(-0.6, 0.6) + (0 if side > 0 else np.pi)
            length = size * rng.uniform(0.12, 0.22)
            x1, y1 = x0 + length * np.cos(angle), y0 + length * np.sin(angle)
            cv2.line(streaks, (int(x0), int(y0)), (int(x1), int(y1)), 1.0, max(1, size // 64))
        return 60 * cv2.GaussianBlur(streaks, (0, 0), size * 0.006) * both
    if label == "covid-19":
        patches = np.zeros((size, size), np.float32)
        for side, _mask in ((-1, left), (1, right)):
            for _ in range(rng.integers(2, 4)):
                cx = 0.5 + side * (anatomy["lung_dx"] + anatomy["lung_w"] * rng.uniform(0.35, 0.75))
                cy = anatomy["lung_cy"] + anatomy["lung_h"] * rng.uniform(-0.3, 0.7)
                patches += _gaussian(size, cx, cy, rng.uniform(0.03, 0.05), rng.uniform(0.04, 0.07))
        return 60 * np.clip(patches, 0, 1.3) * both
    return np.zeros((size, size), np.float32)


def _patient_anatomy(rng) -> dict:
    return {
        "body_w": rng.uniform(0.36, 0.44),
        "lung_dx": rng.uniform(0.15, 0.19),
        "lung_cy": rng.uniform(0.45, 0.52),
        "lung_w": rng.uniform(0.1, 0.13),
        "lung_h": rng.uniform(0.22, 0.28),
        "lung_tilt": rng.uniform(4, 12),
        "heart": rng.uniform(0.07, 0.1),
        "rib_gap": rng.uniform(0.045, 0.06),
        "tissue": rng.uniform(120, 150),
    }


def _rib_shapes(rng) -> list[tuple[float, float, float, float]]:
    """Each rib's own (shift in rib gaps, width and height factors, tilt in degrees), for more ribs than a lung holds.

    Without them every phantom's ribs were the same drawn arcs a few smooth parameters apart, and two patients of
    similar build fitted one similarity with 30-60 keypoints: dedup took them for one radiograph (issue 26).
    Drawn from their own generator, so the rest of the phantom set is the same as before.
    """
    return [
        (rng.uniform(-0.25, 0.25), rng.uniform(0.85, 1.15), rng.uniform(0.8, 1.25), rng.uniform(-6, 6))
        for _ in range(64)
    ]


def render_phantom(label: str, anatomy: dict, size: int, rng) -> np.ndarray:
    """One radiograph of a patient: anatomy, the class finding, then pose, exposure and noise."""
    image = np.full((size, size), 15.0, np.float32)
    body = np.zeros((size, size), np.float32)
    cv2.ellipse(
        body, (size // 2, int(size * 0.55)), (int(size * anatomy["body_w"]), int(size * 0.5)), 0, 0, 360, 1.0, -1
    )
    image += anatomy["tissue"] * cv2.GaussianBlur(body, (0, 0), size * 0.03)
    lungs = _lung_masks(size, anatomy)
    image -= 85 * np.maximum(*lungs)
    ribs = np.zeros((size, size), np.float32)
    y, shapes = anatomy["lung_cy"] - anatomy["lung_h"], iter(anatomy["rib_shapes"])
    while y < anatomy["lung_cy"] + anatomy["lung_h"]:
        for side in (-1, 1):
            dy, width, height, tilt = next(shapes)
            centre = (int(size * 0.5), int(size * (y - 0.05 + dy * anatomy["rib_gap"])))
            cv2.ellipse(
                ribs,
                centre,
                (int(size * 0.3 * width), int(size * 0.08 * height)),
                side * tilt,
                0 if side > 0 else 90,
                90 if side > 0 else 180,
                1.0,
                max(1, size // 90),
            )
        y += anatomy["rib_gap"]
    image += 22 * cv2.GaussianBlur(ribs, (0, 0), size * 0.004) * np.maximum(*lungs)
    image += 70 * _gaussian(size, 0.5, 0.5, 0.035, 0.5)  # spine and mediastinum
    image += 60 * _gaussian(size, 0.53, anatomy["lung_cy"] + 0.12, anatomy["heart"], anatomy["heart"] * 0.8)
    image += _finding(label, size, lungs, anatomy, rng)
    angle, scale = rng.uniform(-5, 5), rng.uniform(0.94, 1.06)
    shift = rng.uniform(-0.03, 0.03, size=2) * size
    matrix = cv2.getRotationMatrix2D((size / 2, size / 2), angle, scale)
    matrix[:, 2] += shift
    image = cv2.warpAffine(image, matrix, (size, size), borderValue=15.0)
    image = image * rng.uniform(0.85, 1.15) + rng.uniform(-15, 15)
    image += rng.normal(0, rng.uniform(3, 8), image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def generate(root: Path, options: SyntheticOptions) -> None:
    """Write the phantom set (PNGs + labels.csv) into `root`; deterministic for given options."""
    rng = np.random.default_rng(options.seed)
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows = []
    for patient in range(options.patients):
        label = LABELS[patient % len(LABELS)]
        anatomy = _patient_anatomy(rng)
        anatomy["rib_shapes"] = _rib_shapes(np.random.default_rng([options.seed, patient]))
        for n in range(int(rng.integers(1, options.max_images_per_patient + 1))):
            name = f"phantom{patient:05d}_{n}.png"
            cv2.imwrite(str(images / name), render_phantom(label, anatomy, options.image_size, rng))
            rows.append({"file": name, "patient": f"{patient:05d}", "label": label, "view": "PA"})
    with open(root / _INDEX, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["file", "patient", "label", "view"])
        writer.writeheader()
        writer.writerows(rows)
    (root / _DONE).write_text(json.dumps(asdict(options)))


@register_source
class SyntheticSource(Source[SyntheticOptions]):
    name = "synthetic"
    Options = SyntheticOptions

    def fetch(self, cache_dir: Path) -> Fetched:
        root = self._given(Path(self.options.from_path)) if self.options.from_path else self._generated(cache_dir)
        return Fetched(root, {})  # made here: no licence, archive or download to record

    def is_root(self, folder: Path) -> bool:
        return (folder / _INDEX).is_file()

    def _given(self, root: Path) -> Path:
        if not self.is_root(root):
            raise UserError(f"{root} is not a synthetic data set (no {_INDEX}); drop from_path to generate one")
        return root

    def _generated(self, cache_dir: Path) -> Path:
        """The phantom set of these options, generated once into the cache (its folder is named by them)."""
        params = {k: v for k, v in asdict(self.options).items() if k != "from_path"}
        root = Path(cache_dir) / ("synthetic-" + "-".join(f"{k}{v}" for k, v in params.items()))
        if not (root / _DONE).is_file():
            generate(root, self.options)
        return root

    def records(self, root: Path) -> Iterator[Record | Dropped]:
        with open(root / _INDEX, newline="") as handle:
            for row in csv.DictReader(handle):
                yield self.record(root / "images" / row["file"], row["label"], row["patient"], view=row["view"])
