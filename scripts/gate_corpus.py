"""The two image sets scripts/bench_gate.py measures the radiograph gate on.

Radiographs: every real radiograph in the shared sample data (`../shared/data`,
see its README), plus pydicom-data's RG1 chest CR when that package is
installed. Non-radiographs, each tagged with a category:

- photo: scikit-image's bundled sample images (no download: the files ship in
  the wheel), colour as they are and as gray PNGs (a gray photo gets past the
  colour check), and the 200 bundled LFW faces;
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


def _ieee8023_rows(shared: Path) -> list[dict]:
    root = shared / "covid-chestxray-sample" / "covid-chestxray-dataset"
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


def radiographs(shared: Path) -> list[Item]:
    items = [Item("chest-xray-pneumonia-224", p) for p in _images_under(shared / "chest-xray-pneumonia-224")]
    items += [
        Item("chest-xray-pneumonia-originals", p) for p in _images_under(shared / "chest-xray-pneumonia-originals")
    ]
    items += [Item("covid19-talo-sample", p) for p in _images_under(shared / "covid19-talo-sample")]
    items += [
        Item("ieee8023 (all X-ray views)", row["path"]) for row in _ieee8023_rows(shared) if row["modality"] == "X-ray"
    ]
    items += [Item("dicom (CR/DX)", p) for p in sorted((shared / "dicom").iterdir()) if not p.name.startswith("CT")]
    rg1 = _pydicom_data_file("RG1_UNCI.dcm")
    if rg1:
        items.append(Item("dicom (CR/DX)", rg1))
    return items


# --- non-radiographs -------------------------------------------------------------------------------------


def _write(path: Path, image: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(path), image):
        raise RuntimeError(f"cannot write {path}")
    return path


def _photos(out: Path) -> list[Item]:
    import skimage

    bundled = Path(skimage.__file__).parent / "data"
    items = []
    for path in sorted(bundled.glob("*")):
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
        if image.ndim == 3:
            gray = cv2.cvtColor(image[:, :, :3], cv2.COLOR_BGR2GRAY)
            items.append(Item("photo", _write(out / "photo-gray" / f"{path.stem}.png", gray), "pixels"))
    faces = np.load(bundled / "lfw_subset.npy")  # 200 gray 25 x 25 faces, float 0..1
    for i, face in enumerate(faces):
        items.append(Item("photo", _write(out / "faces" / f"face{i:03d}.png", np.round(face * 255).astype(np.uint8))))
    return items


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


def non_radiographs(shared: Path, out: Path) -> list[Item]:
    return _photos(out) + _documents(out) + _blank_and_noise(out) + _scans(shared, out)
