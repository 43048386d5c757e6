"""The two image sets scripts/bench_gate.py measures the radiograph gate on.

Radiographs: every real radiograph in the shared sample data (`../shared/data`,
see its README: the Kaggle set at 224 px and its originals, the talo sample and
its NIH films at 512 px, the ieee8023 sample and the whole Aug-2020 snapshot at
768 px, the DICOM CR/DX files), plus pydicom-data's RG1 chest CR when that
package is installed.

Odd films (`odd_films`): real films of three collections (Kaggle 224 px, NIH
512 px, ieee8023 768 px) shown inverted, upside down, or both, as a viewer or
a DICOM export with a wrong MONOCHROME tag or a scanner fed the wrong way
round gives them: each must be turned back or refused, never given another
diagnosis than the film itself. Partial films (`partial_films`): the left,
right and top halves of the same films, as a user's crop gives them; measured
the same way, with no goal yet.

Non-radiographs, each tagged with a category:

- photo: scikit-image's bundled sample images (no download: the files ship in
  the wheel), colour as they are and as gray PNGs (a gray photo gets past the
  colour check), and the 200 bundled LFW faces; scikit-learn's `china` photo;
  each gray photo also as a centre crop, turned 90 degrees, and mirrored and
  blurred (the round-3 reliability report's photo set);
- photo-of-film: the three ieee8023 figures that are phone photos of a film on
  a monitor (PHOTOGRAPHED_FILMS), as they are and as gray PNGs;
- screenshot: real films shown in a dark viewer window with overlay text (the
  report's PACS screenshot), and one on a light page;
- document: pages and screenshots of text rendered with OpenCV (dark on light,
  light on dark, several sizes and aspect ratios) and scikit-image's scanned page;
- blank: constant, near-constant and smooth-gradient images;
- noise: uniform, Gaussian, salt-and-pepper, smoothed noise, a 16 x 4000 strip;
- ct: the ieee8023 sample's CT figures (modality CT in metadata.csv), the CT
  DICOM in shared/data/dicom and pydicom's CT test files;
- other-body-part: real non-chest scans: pydicom-data's RG3 (CR of a tibia),
  MR2 (shoulder MR), an abdominal MR, a whole-body bone scintigram, an
  ultrasound, and pydicom's head MR/CT.

DICOM non-radiographs appear twice: as the file (predict refuses most by their
Modality tag) and as a gray PNG of their pixels (`pixels`), which only the
gate itself can refuse.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

RASTER = (".png", ".jpg", ".jpeg")


@dataclass(frozen=True)
class Item:
    category: str
    path: Path
    form: str = "file"  # "file": as a user would pass it; "pixels": the decoded pixels as a gray PNG


def _images_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in RASTER and not p.name.startswith("."))


def _ieee8023_rows(shared: Path, collection: str = "covid-chestxray-sample") -> list[dict]:
    root = shared / collection / "covid-chestxray-dataset"
    with open(root / "metadata.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    return [
        {**row, "path": root / "images" / row["filename"]}
        for row in rows
        if (root / "images" / row["filename"]).is_file()
    ]


def _pydicom_data_file(name: str) -> Path | None:
    try:
        import data_store  # pydicom-data
    except ImportError:
        return None
    path = Path(data_store.__file__).parent / "data" / name
    return path if path.is_file() else None


def _pydicom_test_file(name: str) -> Path:
    from pydicom.data import get_testdata_file

    return Path(get_testdata_file(name, download=False))


# Films of the shared data that are themselves stored odd, found by the orientation check and confirmed by eye: they
# count with the odd films (the upright film being the file turned back), not as radiographs the gate must pass.
KNOWN_ODD = {
    "CR-fake-MONO1-retagged-MONO2-pixels.dcm": "inverted",  # MONOCHROME2 pixels tagged MONOCHROME1 (its README)
    "00003490_011.png": "upside-down",  # an NIH film stored turned 180 degrees (diaphragm at the top)
}

# ieee8023 files that are phone photos of a film on a monitor (a purple cast, moire, a mouse pointer, the journal's
# panel letter; looked at by eye). metadata.csv lists them as X-rays, but a model that classifies a phone photo of
# a film is silently wrong (the round-3 reliability report, N3), and held-out phone photos of films are counted as
# images to refuse: they count with the non-radiographs (`photo-of-film`), not as radiographs the gate must pass.
PHOTOGRAPHED_FILMS = {"tpmd200203f2-a.png", "tpmd200203f2-b.png", "tpmd200203f2-c.png"}


def radiographs(shared: Path) -> list[Item]:
    items = [Item("chest-xray-pneumonia-224", p) for p in _images_under(shared / "chest-xray-pneumonia-224")]
    items += [
        Item("chest-xray-pneumonia-originals", p) for p in _images_under(shared / "chest-xray-pneumonia-originals")
    ]
    items += [Item("covid19-talo-sample", p) for p in _images_under(shared / "covid19-talo-sample")]
    items += [Item("covid19-talo-nih-512", p) for p in _images_under(shared / "covid19-talo-nih-half-512")]
    items += [
        Item("ieee8023 (all X-ray views)", row["path"]) for row in _ieee8023_rows(shared) if row["modality"] == "X-ray"
    ]
    items += [
        Item("ieee8023-768 (all X-ray views)", row["path"])
        for row in _ieee8023_rows(shared, "covid-chestxray-aug2020-768")
        if row["modality"] == "X-ray"
    ]
    items += [Item("dicom (CR/DX)", p) for p in sorted((shared / "dicom").iterdir()) if not p.name.startswith("CT")]
    rg1 = _pydicom_data_file("RG1_UNCI.dcm")
    if rg1:
        items.append(Item("dicom (CR/DX)", rg1))
    return [item for item in items if item.path.name not in KNOWN_ODD and item.path.name not in PHOTOGRAPHED_FILMS]


# --- non-radiographs -------------------------------------------------------------------------------------


def _write(path: Path, image: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(path), image):
        raise RuntimeError(f"cannot write {path}")
    return path


def photo_variants(gray: np.ndarray) -> dict[str, np.ndarray]:
    """A gray photo as the round-3 report varied it: a centre crop, turned 90 degrees, mirrored and blurred."""
    height, width = gray.shape
    return {
        "crop": gray[height // 4 : height - height // 4, width // 4 : width - width // 4],
        "rot90": np.ascontiguousarray(np.rot90(gray)),
        "mirror-blur": cv2.GaussianBlur(gray[:, ::-1], (0, 0), 1.5),
    }


def _photos(out: Path) -> list[Item]:
    import skimage
    import sklearn.datasets

    bundled = Path(skimage.__file__).parent / "data"
    china = Path(sklearn.datasets.__file__).parent / "images" / "china.jpg"
    items = []
    for path in [*sorted(bundled.glob("*")), china]:
        if path.suffix.lower() not in (".png", ".jpg") or path.stem in (
            "page",
            "text",
            "chessboard_GRAY",
            "chessboard_RGB",
            "phantom",
        ):
            continue  # documents, patterns and the CT phantom are in their own categories
        image = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
        if image is None:
            continue
        items.append(Item("photo", path))
        gray = cv2.cvtColor(image[:, :, :3], cv2.COLOR_BGR2GRAY) if image.ndim == 3 else image
        if image.ndim == 3:
            items.append(Item("photo", _write(out / "photo-gray" / f"{path.stem}.png", gray), "pixels"))
        if image.dtype == np.uint8 and min(gray.shape) >= 128:
            for name, variant in photo_variants(gray).items():
                items.append(
                    Item("photo", _write(out / "photo-variants" / f"{path.stem}-{name}.png", variant), "pixels")
                )
    faces = np.load(bundled / "lfw_subset.npy")  # 200 gray 25 x 25 faces, float 0..1
    for i, face in enumerate(faces):
        items.append(Item("photo", _write(out / "faces" / f"face{i:03d}.png", np.round(face * 255).astype(np.uint8))))
    return items


def viewer_screenshot(film: np.ndarray, width: int, height: int, background: int, ink: int, seed: int) -> np.ndarray:
    """`film` fitted into a viewer window of width x height on a flat background, with overlay text in the corners
    (patient, study, window/level, zoom) as a PACS screenshot shows it."""
    rng = np.random.default_rng(seed)
    screen = np.full((height, width), background, np.uint8)
    scale = min(height * 0.92 / film.shape[0], width * 0.7 / film.shape[1])
    shown = cv2.resize(film, (round(film.shape[1] * scale), round(film.shape[0] * scale)), interpolation=cv2.INTER_AREA)
    top, left = (height - shown.shape[0]) // 2, (width - shown.shape[1]) // 2
    screen[top : top + shown.shape[0], left : left + shown.shape[1]] = shown
    lines = [
        f"PATIENT^NAME {rng.integers(10**6, 10**7)}",
        f"DOB 19{rng.integers(30, 99)}-0{rng.integers(1, 9)}-1{rng.integers(0, 9)}  M",
        "CR CHEST PA  Series 1 Img 1",
        f"W:{rng.integers(2000, 4000)} L:{rng.integers(1000, 2000)}",
        f"Zoom {scale:.2f}  Se:1 Im:1",
        "2020-03-14 09:41:07",
    ]
    for i, line in enumerate(lines):
        x = 12 if i % 2 == 0 else width - 12 - 11 * len(line)
        y = 28 + 26 * (i // 2) if i < 4 else height - 20 - 26 * (i - 4)
        cv2.putText(screen, line, (max(0, x), y), cv2.FONT_HERSHEY_SIMPLEX, 0.6, ink, 1, cv2.LINE_AA)
    return screen


def _screenshots(shared: Path, out: Path) -> list[Item]:
    films = [
        shared / "covid19-talo-sample" / "X-Ray Image DataSet" / "No_findings" / name
        for name in sorted(os.listdir(shared / "covid19-talo-sample" / "X-Ray Image DataSet" / "No_findings"))[:3]
    ] + _odd_film_sources(shared)[::4]
    windows = [(1920, 1080, 20, 220), (1280, 1024, 0, 255), (1600, 900, 45, 200), (1920, 1080, 235, 10)]
    items = []
    for i, film in enumerate(films):
        width, height, background, ink = windows[i % len(windows)]
        shot = viewer_screenshot(cv2.imread(str(film), cv2.IMREAD_GRAYSCALE), width, height, background, ink, seed=i)
        items.append(Item("screenshot", _write(out / "screenshots" / f"{film.stem}-viewer{i}.png", shot)))
    return items


def _odd_film_sources(shared: Path) -> list[Path]:
    kaggle = sorted((shared / "chest-xray-pneumonia-224" / "chest_xray" / "test").rglob("*.jpeg"))[::78]
    nih = sorted((shared / "covid19-talo-nih-half-512").rglob("*.png"))[::87]
    ieee = [
        row["path"]
        for row in _ieee8023_rows(shared, "covid-chestxray-aug2020-768")
        if row["modality"] == "X-ray" and row["view"] in ("PA", "AP")
    ][::60]
    return kaggle + nih + ieee


ODD_VIEWS = {
    "inverted": lambda gray: 255 - gray,
    "upside-down": lambda gray: np.ascontiguousarray(gray[::-1, ::-1]),
    "inverted-upside-down": lambda gray: np.ascontiguousarray(255 - gray[::-1, ::-1]),
}


# Part of a film, as a user may crop one (the round-3 reliability report's N3: "half films are classified too").
# Not odd the way ODD_VIEWS are (nothing the orientation check is for), so measured apart from them.
PARTIAL_VIEWS = {
    "left-half": lambda gray: np.ascontiguousarray(gray[:, : gray.shape[1] // 2]),
    "right-half": lambda gray: np.ascontiguousarray(gray[:, gray.shape[1] // 2 :]),
    "top-half": lambda gray: np.ascontiguousarray(gray[: gray.shape[0] // 2]),
}


def _copies(shared: Path, folder: Path, views: dict) -> list[tuple[Path, Path, str]]:
    """(the film, its copy, the view's name) for every film of `_odd_film_sources` and every entry of `views`."""
    pairs = []
    for film in _odd_film_sources(shared):
        gray = cv2.imread(str(film), cv2.IMREAD_GRAYSCALE)
        for view, change in views.items():
            pairs.append((film, _write(folder / f"{film.stem}-{view}.png", change(gray)), view))
    return pairs


def partial_films(shared: Path, out: Path) -> list[tuple[Path, Path, str]]:
    """(the whole film, a part of it, which part) for every film of `_odd_film_sources` and every PARTIAL_VIEWS entry."""
    return _copies(shared, out / "partial-films", PARTIAL_VIEWS)


def odd_films(shared: Path, out: Path) -> list[tuple[Path, Path, str]]:
    """(the upright film, the odd copy, how it is odd) for every film of `_odd_film_sources` and every ODD_VIEWS
    entry, and for the KNOWN_ODD files of the shared data (the upright film: the file turned back)."""
    from covidxray.edge.preprocess import load_gray

    pairs = _copies(shared, out / "odd-films", ODD_VIEWS)
    for path in [*sorted((shared / "dicom").iterdir()), *_images_under(shared / "covid19-talo-nih-half-512")]:
        if path.name in KNOWN_ODD:
            upright = ODD_VIEWS[KNOWN_ODD[path.name]](load_gray(path))  # each view is its own inverse
            pairs.append(
                (_write(out / "odd-films" / f"{path.stem}-turned-back.png", upright), path, KNOWN_ODD[path.name])
            )
    return pairs


def _text_lines(count: int, seed: int) -> list[str]:
    """Real prose: lines of this repository's README, in a seeded order."""
    readme = Path(__file__).resolve().parents[1] / "README.md"
    lines = [line.strip() for line in readme.read_text().splitlines() if len(line.strip()) > 20]
    rng = np.random.default_rng(seed)
    return [lines[i] for i in rng.integers(0, len(lines), count)]


def _render_page(width: int, height: int, scale: float, background: int, ink: int, seed: int) -> np.ndarray:
    page = np.full((height, width), background, np.uint8)
    line_height = int(32 * scale)
    for row, line in enumerate(_text_lines(height // line_height, seed)):
        y = (row + 1) * line_height
        cv2.putText(
            page,
            line[: int(width / (16 * scale))],
            (int(20 * scale), y),
            cv2.FONT_HERSHEY_SIMPLEX,
            scale,
            ink,
            max(1, round(2 * scale)),
            cv2.LINE_AA,
        )
    return page


def _documents(out: Path) -> list[Item]:
    import skimage

    bundled = Path(skimage.__file__).parent / "data"
    items = [Item("document", bundled / "page.png"), Item("document", bundled / "text.png")]
    shapes = [(1240, 1754), (1754, 1240), (1920, 1080), (1080, 1920), (800, 800), (1024, 768)]  # A4 both ways, screens
    colours = [(255, 0), (240, 40), (0, 220), (30, 200), (200, 60)]  # (background, ink): paper, terminal, UI
    for i, ((width, height), (background, ink)) in enumerate((s, c) for s in shapes for c in colours):
        scale = (0.6, 1.0, 1.6)[i % 3]
        page = _render_page(width, height, scale, background, ink, seed=i)
        items.append(Item("document", _write(out / "documents" / f"page{i:02d}.png", page)))
        if i % 3 == 0:  # a screenshot saved as JPEG: ringing adds gray levels
            jpeg = out / "documents" / f"page{i:02d}.jpg"
            cv2.imwrite(str(jpeg), page, [cv2.IMWRITE_JPEG_QUALITY, 75])
            items.append(Item("document", jpeg))
    items.append(Item("document", bundled / "chessboard_GRAY.png"))
    return items


def _blank_and_noise(out: Path) -> list[Item]:
    rng = np.random.default_rng(0)
    size = 512
    ramp = np.tile(np.linspace(0, 255, size), (size, 1))
    yy, xx = np.mgrid[:size, :size]
    radial = np.clip(255 - np.hypot(yy - size / 2, xx - size / 2), 0, 255)
    blank = {
        "white": np.full((size, size), 255),
        "black": np.zeros((size, size)),
        "gray": np.full((size, size), 128),
        "near-constant": 128 + rng.normal(0, 2, (size, size)),
        "ramp": ramp,
        "ramp-vertical": ramp.T,
        "radial": radial,
        "white-1024x768": np.full((768, 1024), 255),
        "black-jpeg": np.zeros((600, 600)),
    }
    noise = {
        "uniform": rng.uniform(0, 255, (size, size)),
        "gaussian": 128 + rng.normal(0, 40, (size, size)),
        "salt-pepper": rng.choice([0, 255], (size, size)),
        "strip-16x4000": rng.uniform(0, 255, (16, 4000)),
        "strip-4000x16": rng.uniform(0, 255, (4000, 16)),
        "uniform-1024": rng.uniform(0, 255, (1024, 1024)),
    }
    for sigma in (2, 8, 32):  # smooth noise: blobs, the hardest for a texture measure
        noise[f"smoothed-{sigma}"] = cv2.normalize(
            cv2.GaussianBlur(rng.normal(0, 1, (size, size)), (0, 0), sigma), None, 0, 255, cv2.NORM_MINMAX
        )
    items = []
    for category, images in (("blank", blank), ("noise", noise)):
        for name, image in images.items():
            suffix = ".jpg" if name.endswith("jpeg") else ".png"
            items.append(
                Item(
                    category,
                    _write(out / category / f"{name}{suffix}", np.clip(np.round(image), 0, 255).astype(np.uint8)),
                )
            )
    return items


def _dicom_pixels(path: Path, out: Path) -> Path | None:
    """A DICOM's display pixels (first frame of a series) as a gray PNG, bypassing the Modality check."""
    import pydicom

    from covidxray.edge.preprocess import dicom_gray

    dataset = pydicom.dcmread(str(path))
    if int(dataset.get("NumberOfFrames", 1) or 1) > 1:
        frame = dataset.pixel_array[0].astype(np.float64)
        gray = np.round((frame - frame.min()) * 255 / max(np.ptp(frame), 1)).astype(np.uint8)
    else:
        gray = dicom_gray(dataset, path)
    return _write(out / f"{path.stem}.png", gray)


def _scans(shared: Path, out: Path) -> list[Item]:
    ct = [row["path"] for row in _ieee8023_rows(shared) if row["modality"] == "CT"]
    items = [Item("ct", p) for p in ct]
    ct_dicom = [
        shared / "dicom" / "CT-abdomen-not-xray.dcm",
        _pydicom_test_file("CT_small.dcm"),
        _pydicom_data_file("693_UNCI.dcm"),
        _pydicom_data_file("explicit_VR-UN.dcm"),
        _pydicom_test_file("J2K_pixelrep_mismatch.dcm"),
    ]
    body = [
        _pydicom_data_file(n)
        for n in (
            "RG3_UNCI.dcm",
            "MR2_UNCI.dcm",
            "MR-SIEMENS-DICOM-WithOverlays.dcm",
            "JPEG2000_UNC.dcm",
            "JPGLosslessP14SV1_1s_1f_8b.dcm",
            "emri_small.dcm",
        )
    ]
    body.append(_pydicom_test_file("MR_small.dcm"))
    for category, files in (("ct", ct_dicom), ("other-body-part", body)):
        for path in files:
            if path is None:
                continue
            items.append(Item(category, path))
            pixels = _dicom_pixels(path, out / "dicom-pixels")
            if pixels:
                items.append(Item(category, pixels, "pixels"))
    return items


def _photographed_films(shared: Path, out: Path) -> list[Item]:
    """PHOTOGRAPHED_FILMS as the files are (colour) and as gray PNGs, which get past the colour check."""
    items = []
    for row in _ieee8023_rows(shared, "covid-chestxray-aug2020-768"):
        if row["filename"] in PHOTOGRAPHED_FILMS:
            gray = cv2.cvtColor(cv2.imread(str(row["path"])), cv2.COLOR_BGR2GRAY)
            items.append(Item("photo-of-film", row["path"]))
            items.append(Item("photo-of-film", _write(out / "photo-of-film" / row["filename"], gray), "pixels"))
    return items


def non_radiographs(shared: Path, out: Path) -> list[Item]:
    return (
        _photos(out)
        + _photographed_films(shared, out)
        + _screenshots(shared, out)
        + _documents(out)
        + _blank_and_noise(out)
        + _scans(shared, out)
    )
