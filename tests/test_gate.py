"""Issue 14: the cheap "is this a chest radiograph" checks, on generated non-radiographs and on real radiographs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import REPO, run_cli

from covidxray.edge import radiograph_gate
from covidxray.edge.preprocess import load_gray

sys.path.insert(0, str(REPO / "scripts"))
from gate_corpus import KNOWN_ODD, PHOTOGRAPHED_FILMS, photo_variants, viewer_screenshot  # noqa: E402


def text_page(width: int = 1240, height: int = 1754, background: int = 255, ink: int = 0) -> np.ndarray:
    page = np.full((height, width), background, np.uint8)
    for row in range(1, height // 40):
        cv2.putText(
            page,
            "The patient was seen on the ward; chest film to follow.",
            (30, row * 40),
            cv2.FONT_HERSHEY_SIMPLEX,
            1.0,
            ink,
            2,
            cv2.LINE_AA,
        )
    return page


def non_radiographs() -> dict[str, tuple[np.ndarray, str]]:
    """name -> (image, the reasons a person would give for refusing it, '|'-separated)."""
    rng = np.random.default_rng(0)
    checker = (np.indices((512, 512)).sum(axis=0) // 64 % 2 * 255).astype(np.uint8)
    return {
        "all white": (np.full((800, 800), 255, np.uint8), "near-uniform"),
        "all black": (np.zeros((800, 600), np.uint8), "near-uniform"),
        "near-constant gray": (np.clip(128 + rng.normal(0, 2, (512, 512)), 0, 255).astype(np.uint8), "near-uniform"),
        "16 x 4000 noise strip": (rng.integers(0, 256, (16, 4000), dtype=np.uint8), "too-small|extreme-aspect"),
        "whole-body strip 1024 x 256": (
            cv2.resize(rng.integers(0, 256, (8, 4), dtype=np.uint8), (256, 1024)),
            "extreme-aspect",
        ),
        "checkerboard": (checker, "few-gray-levels"),
        "uniform noise": (rng.integers(0, 256, (512, 512), dtype=np.uint8), "text-or-noise"),
        "25 px face-sized thumbnail": (cv2.resize(rng.integers(0, 256, (5, 5), dtype=np.uint8), (25, 25)), "too-small"),
        "linear gradient": (np.tile(np.linspace(0, 255, 512), (512, 1)).astype(np.uint8), "too-smooth"),
        "document page": (text_page(), "few-gray-levels|text-or-noise"),
        "terminal screenshot": (text_page(1920, 1080, background=20, ink=220), "few-gray-levels|text-or-noise"),
    }


@pytest.mark.parametrize("name", list(non_radiographs()))
def test_non_radiographs_are_rejected_for_the_right_reason(name):
    image, reasons = non_radiographs()[name]
    result = radiograph_gate.check(image)
    assert result.reason in reasons.split("|"), (name, radiograph_gate.features(image))
    assert result.detail.startswith("not a chest radiograph")


def test_the_first_failing_check_names_its_feature_value():
    image = np.full((300, 300), 200, np.uint8)
    image[:2] = 0  # a black band on 0.7% of the pixels: below the 1st percentile, so the spread is 0
    result = radiograph_gate.check(image)
    assert (result.reason, result.score, result.limit) == ("near-uniform", 0.0, 24.0)


def real_radiographs(shared) -> list:
    """Every real radiograph of the small sets and every 10th of the 5,856 Kaggle images (all of them: scripts/bench_gate.py)."""
    kaggle = sorted((shared / "chest-xray-pneumonia-224").rglob("*.jpeg"))[::10]
    others = [
        p
        for folder in ("chest-xray-pneumonia-originals", "covid19-talo-sample")
        for p in sorted((shared / folder).rglob("*"))
        if p.suffix.lower() in (".jpeg", ".jpg", ".png")
    ]
    ieee = shared / "covid-chestxray-sample" / "covid-chestxray-dataset"
    import csv

    with open(ieee / "metadata.csv", newline="") as handle:
        xrays = [ieee / "images" / row["filename"] for row in csv.DictReader(handle) if row["modality"] == "X-ray"]
    dicom = [p for p in sorted((shared / "dicom").iterdir()) if not p.name.startswith(("CT", INVERTED_FILM[:12]))]
    return kaggle + others + [p for p in xrays if p.is_file()] + dicom


INVERTED_FILM = "CR-fake-MONO1-retagged-MONO2-pixels.dcm"  # MONOCHROME2 pixels tagged MONOCHROME1: shows as a negative


def histogram_percentiles(values: np.ndarray, percents) -> np.ndarray:
    return radiograph_gate.percentiles_of_histogram(np.bincount(values.ravel(), minlength=256), percents)


def assert_bitwise_equal(found: np.ndarray, expected: np.ndarray, what) -> None:
    assert found.dtype == expected.dtype == np.float64 and found.tobytes() == expected.tobytes(), (
        what,
        found,
        expected,
    )


def test_percentiles_from_the_histogram_are_numpys_bit_for_bit_on_constructed_values():
    rng = np.random.default_rng(0)
    percents = (1, 99, 0, 100, 50, 0.5, 99.5, 25, 75, 33.3, 66.7, 2.5, 97.5)
    cases = {
        "one value": np.array([7], np.uint8),
        "two values": np.array([0, 255], np.uint8),
        "constant 0": np.zeros((30, 40), np.uint8),
        "constant 255": np.full((17, 5), 255, np.uint8),
        "constant 77, 256 px thumbnail": np.full((256, 200), 77, np.uint8),
        # the 1st percentile's neighbours straddle a run of ties: 99 values, so its virtual index is 0.98
        "one low outlier": np.array([3] + [200] * 98, np.uint8),
        "101 values: virtual indices 1.0 and 99.0": np.arange(101, dtype=np.uint8),
        "two runs meeting at the 99th percentile": np.array([10] * 99 + [250] * 2, np.uint8),
    }
    for n in (*range(1, 40), 99, 100, 101, 199, 200, 201, 1000, 65536, 256 * 171):
        cases[f"{n} random values"] = rng.integers(0, 256, n, dtype=np.uint8)
        cases[f"{n} values of three levels"] = rng.choice(np.array([0, 128, 255], np.uint8), n)
    for what, values in cases.items():
        for chosen in ((1, 99), percents):
            assert_bitwise_equal(histogram_percentiles(values, chosen), np.percentile(values, chosen), (what, chosen))


def test_percentiles_from_the_histogram_are_numpys_bit_for_bit_on_real_thumbnails(shared_data):
    from covidxray.edge.preprocess import ImageError

    paths = [
        *sorted((shared_data / "covid-chestxray-aug2020-768").rglob("*.*"))[::6],
        *sorted((shared_data / "chest-xray-pneumonia-224").rglob("*.jpeg"))[::100],
        *sorted((shared_data / "covid19-talo-nih-half-512").rglob("*.png"))[::20],
    ]
    checked = 0
    for path in paths:
        try:
            thumbnail = radiograph_gate._thumbnail(load_gray(path))
        except ImageError:
            continue
        assert_bitwise_equal(histogram_percentiles(thumbnail, (1, 99)), np.percentile(thumbnail, (1, 99)), path.name)
        checked += 1
    assert checked > 150


def test_real_radiographs_all_pass(shared_data):
    from covidxray.edge.preprocess import ImageError

    checked, rejected = 0, []
    for path in real_radiographs(shared_data):
        try:
            gray = load_gray(path)
        except ImageError:
            continue  # not decodable here (a JPEG-LS codec, a colour figure): not the gate's call
        checked += 1
        result = radiograph_gate.check(gray)
        if not result.passed:
            rejected.append((path.name, result.reason, result.score))
    assert checked > 700 and rejected == []


def test_prepare_drops_non_radiographs_with_a_counted_reason(shared_data, tmp_path):
    import shutil

    source = tmp_path / "talo"
    shutil.copytree(shared_data / "covid19-talo-sample", source)
    folder = source / "X-Ray Image DataSet" / "No_findings"
    kept = len(list(folder.iterdir()))
    cv2.imwrite(str(folder / "00099999_000.png"), np.full((1024, 1024), 255, np.uint8))
    cv2.imwrite(str(folder / "00099998_000.png"), text_page())
    data_dir = tmp_path / "data"
    result = run_cli(
        "prepare", "--source", "covid19-talo", "--from", str(source), "--data-dir", str(data_dir), "--image-size", "64"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    manifest = json.loads((data_dir / "manifest.json").read_text())
    assert manifest["dropped"].get("covid19-talo: image not-radiograph") == 2, manifest["dropped"]
    assert sum(info["classes"].get("normal", 0) for info in manifest["splits"].values()) == kept
    dropped = (data_dir / "dropped.csv").read_text()
    assert "00099999_000.png,not a chest radiograph:" in dropped and "(near-uniform)" in dropped
    assert "00099998_000.png,not a chest radiograph:" in dropped and "(text-or-noise)" in dropped


def smoothed_noise(sigma: float, size: int = 512, seed: int = 7) -> np.ndarray:
    noise = cv2.GaussianBlur(np.random.default_rng(seed).normal(0, 1, (size, size)), (0, 0), sigma)
    return cv2.normalize(noise, None, 0, 255, cv2.NORM_MINMAX).astype(np.uint8)


@pytest.mark.parametrize("name", ["brick.png", "page.png", "text.png", "microaneurysms.png"])
def test_real_textures_and_scanned_print_are_busy_at_9_px(name):
    """scikit-image's bundled photos of a brick wall, a scanned page, printed text and a retinal micrograph."""
    skimage = pytest.importorskip("skimage")
    result = radiograph_gate.check(load_gray(Path(skimage.__file__).parent / "data" / name))
    assert result.reason == "busy-texture" and result.score > result.limit


@pytest.mark.parametrize("name", ["MR_small.dcm", "emri_small.dcm"])
def test_small_mr_slices_are_busy_at_9_px(name):
    """pydicom's 64 px MR test images, as pixels (decoding them as DICOM already refuses Modality MR)."""
    from pydicom import dcmread
    from pydicom.data import get_testdata_file

    from covidxray.edge.preprocess import dicom_gray

    dataset = dcmread(get_testdata_file(name, download=False))
    if dataset.pixel_array.ndim == 3:  # a series: its first frame, full range
        gray = cv2.normalize(dataset.pixel_array[0].astype(np.float64), None, 0, 255, cv2.NORM_MINMAX).astype(np.uint8)
    else:
        gray = dicom_gray(dataset)
    assert radiograph_gate.check(gray).reason == "busy-texture"


@pytest.mark.parametrize("sigma", [2, 3, 5, 8, 12])
def test_smoothed_noise_is_refused_at_every_blob_size(sigma):
    """Gaussian-smoothed white noise, 700 px: the finest is noise at 3 px, then busy at 9 px, coarse blobs have no fine grain."""
    assert radiograph_gate.check(smoothed_noise(sigma, 700)).reason in (
        "text-or-noise",
        "busy-texture",
        "grainless-blobs",
    )


def test_low_resolution_radiographs_blown_up_still_pass(shared_data):
    """A real film shrunk to 128 px and enlarged 4x (as a thumbnail pasted into a report) is still a radiograph."""
    films = sorted((shared_data / "chest-xray-pneumonia-224").rglob("*.jpeg"))[::300]
    for path in films:
        small = cv2.resize(load_gray(path), (128, 128), interpolation=cv2.INTER_AREA)
        result = radiograph_gate.check(cv2.resize(small, (512, 512), interpolation=cv2.INTER_CUBIC))
        assert result.passed, (path.name, result)


def test_a_film_printed_in_one_tint_is_a_radiograph_and_colour_photos_are_not(shared_data):
    """ieee8023's 000005-5-a.jpg is a PA film printed in blue; scikit-image's colour photos stay refused by decoding."""
    from covidxray.edge.preprocess import ImageError

    tinted = shared_data / "covid-chestxray-sample" / "covid-chestxray-dataset" / "images" / "000005-5-a.jpg"
    assert cv2.imread(str(tinted)).std(axis=2).mean() > 10  # really in colour
    assert radiograph_gate.check(load_gray(tinted)).passed
    skimage = pytest.importorskip("skimage")
    photos = [
        "astronaut.png",
        "chelsea.png",
        "coffee.png",
        "ihc.png",
        "retina.jpg",
        "rocket.jpg",
        "motorcycle_left.png",
    ]
    for name in photos:
        with pytest.raises(ImageError) as caught:
            load_gray(Path(skimage.__file__).parent / "data" / name)
        assert caught.value.reason == "not-xray" and "colour image" in caught.value.detail, name


def test_the_phone_photos_of_films_on_a_monitor_are_refused_as_colour(shared_data):
    """ieee8023 lists tpmd200203f2-a/b/c as X-rays; they are phone photos of a film on a monitor (purple cast), which
    the gate corpus counts as images to refuse (gate_corpus.PHOTOGRAPHED_FILMS): the decoder's colour check does."""
    from covidxray.edge.preprocess import ImageError

    images = shared_data / "covid-chestxray-aug2020-768" / "covid-chestxray-dataset" / "images"
    if not images.is_dir():
        pytest.skip("the full ieee8023 snapshot is not in ../shared/data")
    for name in sorted(PHOTOGRAPHED_FILMS):
        blue, green, red = cv2.split(cv2.imread(str(images / name)).astype(np.int16))
        assert (np.abs(red - green).mean() > 10) and (np.abs(blue - green).mean() > 10), name  # really tinted
        with pytest.raises(ImageError) as caught:
            load_gray(images / name)
        assert caught.value.reason == "not-xray" and "colour image" in caught.value.detail, name


# --- the chest-layout score (covidxray/edge/chest_layout.py) ----------------------------------------------


def kaggle_films(shared, folder: str) -> list:
    return sorted((shared / "chest-xray-pneumonia-224" / "chest_xray" / folder).rglob("*.jpeg"))


def model_input(path, size: int = 128) -> np.ndarray:
    from covidxray.edge.preprocess import as_model_input

    return as_model_input(load_gray(path), size)


@pytest.fixture(scope="module")
def layout_of_real_films():
    """Fitted as export fits it, on every 6th film of the Kaggle train folder; threshold from another 6th."""
    from conftest import SHARED_DATA

    from covidxray.config import ExportConfig
    from covidxray.edge import chest_layout

    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data not present")
    films = kaggle_films(SHARED_DATA, "train")
    entry = chest_layout.fit_with_threshold(
        map(model_input, films[::6]), map(model_input, films[3::6]), ExportConfig().layout_margin
    )
    return chest_layout.LayoutModel.from_sidecar(entry)


def test_real_films_the_layout_fit_never_saw_pass_it(layout_of_real_films, shared_data):
    """Other films of the same collection, other hospitals' PNGs, journal figures, DICOM CR/DX (one an inverted film)."""
    from covidxray.edge.preprocess import ImageError

    held_out = kaggle_films(shared_data, "test")[::5] + [
        p for p in real_radiographs(shared_data) if "chest-xray-pneumonia-224" not in str(p)
    ]
    scored, refused = 0, []
    for path in held_out:
        try:
            image = model_input(path)
        except ImageError:
            continue  # not decodable here: not the gate's call
        scored += 1
        score = layout_of_real_films.score(image)
        if score > layout_of_real_films.threshold:
            refused.append((path.name, score))
    assert scored > 250 and refused == [], (layout_of_real_films.threshold, refused)


@pytest.fixture(scope="module")
def orientation_of_real_films():
    """Fitted as export fits it: on the Kaggle train folder's films, every n-th when there are more than
    orientation.MAX_FILMS (5,216: every 2nd)."""
    from conftest import SHARED_DATA

    from covidxray.edge import orientation

    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data not present")
    films = kaggle_films(SHARED_DATA, "train")
    step = -(-len(films) // orientation.MAX_FILMS)
    entry = orientation.fit_entry(map(model_input, films[::step]), map(model_input, films[3::60]))
    return orientation.OrientationModel.from_sidecar(json.loads(json.dumps(entry)))


def odd_views(image: np.ndarray) -> dict[str, np.ndarray]:
    return {"inverted": 255 - image, "upside-down": image[::-1, ::-1], "inverted-upside-down": 255 - image[::-1, ::-1]}


def test_n3_inverted_and_upside_down_films_are_refused_and_upright_ones_are_not(orientation_of_real_films, shared_data):
    """The round-3 report's N3 films (NIH normal 0.74 -> inverted pneumonia 0.90; Kaggle normal 0.90 ->
    upside-down pneumonia 0.83), here for films of three collections the fit never saw: the Kaggle test
    folder (224 px), the NIH films of the talo sample (1024 px) and the ieee8023 sample's PA films."""
    import csv

    ieee = shared_data / "covid-chestxray-sample" / "covid-chestxray-dataset"
    with open(ieee / "metadata.csv", newline="") as handle:
        pa = [
            ieee / "images" / r["filename"]
            for r in csv.DictReader(handle)
            if r["view"] == "PA" and r["modality"] == "X-ray"
        ]
    films = (
        kaggle_films(shared_data, "test")[::40]
        + sorted((shared_data / "covid19-talo-sample" / "X-Ray Image DataSet").glob("[NP]*/*.png"))
        + [p for p in pa if p.is_file()]
    )
    turned = []
    for path in films:
        image = model_input(path)
        assert orientation_of_real_films.orientation(image)[0] == "upright", path.name
        for view, odd in odd_views(image).items():
            found = orientation_of_real_films.orientation(odd)[0]
            turned.append(found == view)
    assert len(films) > 30 and np.mean(turned) >= 0.97, np.mean(turned)


def test_a_fit_on_childrens_films_refuses_no_upright_adult_film_of_another_hospital(
    orientation_of_real_films, shared_data
):
    """Every NIH film of the shared half of talo's patients (523 adults, 512 px), against a fit on Kaggle's
    children only: the one film NIH itself stores upside down (gate_corpus.KNOWN_ODD) is refused as such and no
    other is. Fitted on every 6th film (870, as when orientation.MAX_FILMS was 2,000), three upright films were
    refused here."""
    films = sorted((shared_data / "covid19-talo-nih-half-512").rglob("*.png"))
    found = {path.name: orientation_of_real_films.orientation(model_input(path))[0] for path in films}
    odd = {name: view for name, view in found.items() if view != "upright"}
    stored_odd = {name: view for name, view in KNOWN_ODD.items() if name in found}
    assert len(films) > 500 and stored_odd and odd == stored_odd, odd


def test_a_letterboxed_film_is_judged_on_the_film(orientation_of_real_films, shared_data):
    """ieee8023 stores some films with black bars (`16708_4_1.jpg`); orientation version 1 refused two such upright
    films as inverted-upside-down. NIH adult films (a fit on children's films never saw one), letterboxed with black
    or white bars of 10-25% of the height and stretched back to the square model input as preprocess does, stay
    upright; turned, they are still refused."""
    films = sorted((shared_data / "covid19-talo-nih-half-512").rglob("*.png"))[::40]
    refused_upright, turned_passed, judged = [], [], 0
    for path in films:
        if path.name in KNOWN_ODD:
            continue
        image = model_input(path)[:, :, 0]
        for share in (0.10, 0.25):
            for bar in (0, 255):
                rows = int(share * len(image))
                boxed = np.pad(image, ((rows, rows), (0, 0)), constant_values=bar)
                boxed = cv2.resize(boxed, image.shape[::-1], interpolation=cv2.INTER_AREA)
                judged += 1
                if orientation_of_real_films.orientation(boxed)[0] != "upright":
                    refused_upright.append((path.name, share, bar))
                for view, odd in odd_views(boxed).items():
                    if orientation_of_real_films.orientation(odd)[0] == "upright":
                        turned_passed.append((path.name, share, bar, view))
    assert judged >= 40 and refused_upright == [], refused_upright
    assert len(turned_passed) <= 0.03 * 3 * judged, turned_passed


def test_a_film_stored_inverted_is_refused_as_inverted(orientation_of_real_films, shared_data):
    """The shared data's MONOCHROME2 pixels tagged MONOCHROME1: decoded as the tag says, it is a negative."""
    image = model_input(shared_data / "dicom" / INVERTED_FILM)
    assert orientation_of_real_films.orientation(image)[0] == "inverted"
    assert orientation_of_real_films.orientation(255 - image)[0] == "upright"


@pytest.mark.parametrize(
    "name",
    ["camera.png", "moon.png", "cell.png", "clock_motion.png", "chelsea.png", "coffee.png", "astronaut.png", "china"],
)
def test_real_gray_photos_are_no_upright_chest_film(layout_of_real_films, orientation_of_real_films, name):
    """scikit-image's bundled photos and scikit-learn's `china` (the round-3 report's N1 escapes), as gray and
    as the report varied them: all pass the cheap checks, and the embedding of a small CNN does not separate
    most of them from films (docs/deploy.md). Each is refused by the chest-layout score or the orientation
    check: it is no upright chest film."""
    pytest.importorskip("skimage")
    from covidxray.edge.preprocess import as_model_input

    if name == "china":
        import sklearn.datasets

        path = Path(sklearn.datasets.__file__).parent / "images" / "china.jpg"
    else:
        import skimage

        path = Path(skimage.__file__).parent / "data" / name
    photo = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
    gray = cv2.cvtColor(photo[:, :, :3], cv2.COLOR_BGR2GRAY) if photo.ndim == 3 else photo
    passed = []
    for variant, image in {"as is": gray, **photo_variants(gray)}.items():
        model = as_model_input(image, 128)
        layout, orientation = layout_of_real_films.score(model), orientation_of_real_films.orientation(model)[0]
        if (
            radiograph_gate.check(image).passed
            and layout <= layout_of_real_films.threshold
            and orientation == "upright"
        ):
            passed.append(variant)
    if name == "camera.png":
        # Known escapes left (docs/deploy.md), where the OOD or chest-layout score of the exported model must do it:
        # its crop and blurred mirror, and the photo as it is (upright 0.18 to an orientation fit on every train
        # film, 0.03 on every 6th; bench_gate's exports refuse it by chest layout, 38.9 > 36.9 and 40.1 > 39.1,
        # this test's limit, fitted on fewer films, is looser).
        assert set(passed) <= {"as is", "crop", "mirror-blur"}, passed
    else:
        assert "as is" not in passed and len(passed) <= 2, (name, passed)


def test_the_layout_entry_survives_the_sidecar_json(layout_of_real_films, shared_data):
    from covidxray.edge import chest_layout

    card = json.loads(json.dumps(layout_of_real_films.to_sidecar({})))
    again = chest_layout.LayoutModel.from_sidecar(card)
    images = [model_input(p) for p in kaggle_films(shared_data, "test")[::50]]
    np.testing.assert_allclose(again.scores(images), layout_of_real_films.scores(images), rtol=1e-6)
    assert again.threshold == layout_of_real_films.threshold
    with pytest.raises(chest_layout.OtherVersion):
        chest_layout.LayoutModel.from_sidecar({**card, "version": chest_layout.VERSION + 1})


def test_n1_a_film_shown_in_a_viewer_window_is_refused_as_framed(shared_data):
    """The round-3 report's PACS screenshot: talo's 00001280_004.png centred in a dark viewer with overlay text
    (pneumonia 0.94 there, where the film alone got normal 0.48). Refused by the cheap checks as `framed`,
    in a 16:9 and a 16:10 window, dark or light; the film itself passes."""
    film = load_gray(shared_data / "covid19-talo-sample" / "X-Ray Image DataSet" / "No_findings" / "00001280_004.png")
    assert radiograph_gate.check(film).passed
    for i, (width, height, background, ink) in enumerate([(1920, 1080, 20, 220), (1680, 1050, 235, 10)]):
        result = radiograph_gate.check(viewer_screenshot(film, width, height, background, ink, seed=i))
        assert result.reason == "framed" and result.score > result.limit, result
