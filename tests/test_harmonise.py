"""Issue 24: data.harmonise takes away frame, burnt-in text and intensity processing, the same at prepare and predict."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import SHARED_DATA, run_cli

from covidxray.edge.harmonise import NONE, TRIM_INPAINT_EQUALISE, harmonised, overlay_mask, trim_flat_border
from covidxray.errors import UserError

METHOD = TRIM_INPAINT_EQUALISE


def _film(size: int = 256, seed: int = 0) -> np.ndarray:  # the working size: harmonised() keeps its geometry
    """A radiograph-like image: smooth anatomy-sized structure plus fine grain, no flat rows or columns."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    lungs = np.exp(-(((x - 0.3) / 0.12) ** 2 + ((y - 0.5) / 0.25) ** 2)) + np.exp(
        -(((x - 0.7) / 0.12) ** 2 + ((y - 0.5) / 0.25) ** 2)
    )
    film = 170 - 90 * lungs + 20 * np.sin(18 * y) + rng.normal(0, 6, (size, size))
    return np.clip(film, 10, 235).astype(np.uint8)


def test_a_frame_added_around_a_film_is_trimmed_away():
    film = _film(400)
    framed = cv2.copyMakeBorder(film, 40, 60, 30, 20, cv2.BORDER_CONSTANT, value=0)
    framed = cv2.copyMakeBorder(framed, 10, 10, 10, 10, cv2.BORDER_CONSTANT, value=255)  # white padding outside
    np.testing.assert_array_equal(trim_flat_border(framed), film)
    mostly_flat = np.zeros((100, 100), np.uint8)
    mostly_flat[45:55, 45:55] = 200  # content under half the side: not a frame, kept whole
    assert trim_flat_border(mostly_flat).shape == (100, 100)


def test_burnt_in_text_is_masked_and_inpainted_but_large_bright_regions_stay():
    film = _film()
    marked = film.copy()
    cv2.putText(marked, "R", (12, 36), cv2.FONT_HERSHEY_SIMPLEX, 0.8, 255, 2)
    cv2.putText(marked, "c", (100, 200), cv2.FONT_HERSHEY_SIMPLEX, 0.8, 0, 2)  # dark text on a figure
    marked[160:256, 190:256] = 255  # a saturated region of 10% of the image: anatomy or exposure, not an overlay
    mask = overlay_mask(marked) > 0
    letter = (marked != film) & ((marked == 255) | (marked == 0))
    letter[160:256, 190:256] = False
    assert mask[letter].mean() > 0.95 and not mask[180:250, 200:250].any()
    out = harmonised(marked, METHOD, 128)
    reference = harmonised(film, METHOD, 128)
    # where the letter was, the film is back (inpainted from around it), as far as the equalised gray levels go
    assert np.abs(out[letter].astype(int) - reference[letter]).mean() < 25
    assert np.abs(harmonised(marked, NONE, 128)[letter].astype(int) - film[letter]).mean() > 60  # ... not before


def test_exposure_and_gamma_differences_are_equalised_away():
    film = _film()
    darker = np.clip(255 * (film / 255.0) ** 1.8 * 0.8, 0, 255).astype(np.uint8)  # another window, gamma and exposure
    before = np.abs(film.astype(int) - darker).mean()
    after = np.abs(harmonised(film, METHOD, 128).astype(int) - harmonised(darker, METHOD, 128)).mean()
    assert before > 40 and after < before / 5


def test_none_is_the_identity_and_an_unknown_method_is_refused():
    film = _film()
    assert harmonised(film, NONE, 128) is film
    with pytest.raises(UserError, match="not a harmonisation"):
        harmonised(film, "histogram-magic", 128)


@pytest.mark.slow
def test_predict_makes_the_pixels_prepare_wrote_into_the_shards(tmp_path):
    """The invariant that makes harmonisation safe: a film's model input at predict = its shard pixels from prepare."""
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data not present")
    from covidxray.data.tfrecord import read_records
    from covidxray.edge.preprocess import as_model_input, load_gray
    from covidxray.manifest import open_prepared

    data_dir = tmp_path / "data"
    result = run_cli(
        "prepare",
        "--source",
        f"covid19-talo={SHARED_DATA / 'covid19-talo-sample'}",
        "--image-size",
        "96",
        "--set",
        f"data.harmonise={METHOD}",
        "--data-dir",
        str(data_dir),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((data_dir / "manifest.json").read_text())
    assert manifest["harmonise"] == METHOD
    with open(data_dir / "splits.csv", newline="") as handle:
        image_of = {Path(row["image"]).name: row["image"] for row in csv.DictReader(handle)}
    records = [r for split in ("train", "val", "test") for r in read_records(open_prepared(data_dir).shards(split))]
    assert len(records) == len(image_of) > 10
    for record in records:
        gray = load_gray(image_of[record["record_id"].split(":")[1]])
        expected = as_model_input(gray, 96, METHOD)
        np.testing.assert_array_equal(record["image"].astype(np.float32), expected)
        assert not np.array_equal(expected, as_model_input(gray, 96))  # and harmonisation did change them
