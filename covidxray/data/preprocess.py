"""Image decoding and resizing shared by `prepare` and `predict`.

Training and inference must see pixels made by exactly the same code, so this
module is the only place that turns a file into model input. It imports no
TensorFlow: `predict` on a Pi loads it beside the LiteRT interpreter only.
Model input is a float32 (size, size, 1) array of gray values 0..255; scaling
to 0..1 happens inside the model.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".dcm", ".dicom")
PREPROCESSING = {
    "decode": "grayscale; 16-bit and DICOM min-max scaled to 8-bit after rescale/VOI, MONOCHROME1 inverted",
    "resize": "cv2.INTER_AREA to size x size (aspect not kept)",
    "input": "float32 gray values 0..255, shape (size, size, 1); the model rescales",
}

# A colour image counts as a photo, not an X-ray, when this share of its pixels
# has channels further apart than COLOUR_SPREAD gray levels (annotations and
# tinted scans stay well below it).
COLOUR_SPREAD = 40
COLOUR_PIXEL_SHARE = 0.05


class ImageError(ValueError):
    """A file that cannot become model input; `reason` is a short countable code."""

    def __init__(self, reason: str, path: Path | str, detail: str):
        super().__init__(f"{path}: {detail}")
        self.reason = reason
        self.path = str(path)
        self.detail = detail


def is_dicom(path: Path) -> bool:
    if path.suffix.lower() in (".dcm", ".dicom"):
        return True
    try:
        with open(path, "rb") as handle:
            handle.seek(128)
            return handle.read(4) == b"DICM"
    except OSError:
        return False


def _to_uint8(pixels: np.ndarray) -> np.ndarray:
    pixels = pixels.astype(np.float64)
    low, high = float(pixels.min()), float(pixels.max())
    if high <= low:
        return np.zeros(pixels.shape, np.uint8)
    return np.round((pixels - low) * (255.0 / (high - low))).astype(np.uint8)


def _load_dicom(path: Path) -> np.ndarray:
    import pydicom
    from pydicom.errors import InvalidDicomError
    from pydicom.pixels import apply_modality_lut, apply_voi_lut

    try:
        dataset = pydicom.dcmread(str(path))
    except (InvalidDicomError, OSError, EOFError, ValueError) as err:
        raise ImageError("unreadable", path, f"not a readable DICOM file ({err})") from None
    if "PixelData" not in dataset:
        raise ImageError("unreadable", path, "DICOM file holds no pixel data")
    if int(getattr(dataset, "NumberOfFrames", 1) or 1) > 1:
        raise ImageError("not-xray", path, f"DICOM with {dataset.NumberOfFrames} frames is a volume, not a radiograph")
    modality = str(getattr(dataset, "Modality", "")).upper()
    if modality in ("CT", "MR", "PT", "NM", "US"):
        raise ImageError("not-xray", path, f"DICOM modality {modality} is not a radiograph")
    try:
        pixels = dataset.pixel_array
    except Exception as err:  # pydicom raises many types for unsupported transfer syntaxes
        raise ImageError("unreadable", path, f"cannot decode DICOM pixels ({err})") from None
    photometric = str(getattr(dataset, "PhotometricInterpretation", "MONOCHROME2")).upper()
    if photometric not in ("MONOCHROME1", "MONOCHROME2"):
        raise ImageError("not-xray", path, f"DICOM photometric {photometric} is not a grayscale radiograph")
    pixels = apply_modality_lut(pixels, dataset)
    pixels = apply_voi_lut(pixels, dataset)
    gray = _to_uint8(pixels)
    if photometric == "MONOCHROME1":
        gray = 255 - gray
    return gray


def _load_raster(path: Path) -> np.ndarray:
    data = np.fromfile(str(path), dtype=np.uint8)
    if data.size == 0:
        raise ImageError("empty", path, "file is empty")
    image = cv2.imdecode(data, cv2.IMREAD_UNCHANGED)
    if image is None or image.size == 0:
        raise ImageError("unreadable", path, "not a decodable image (corrupt, truncated or not an image)")
    if image.ndim == 3:
        if image.shape[2] == 4:
            image = image[:, :, :3]
        spread = image.max(axis=2).astype(np.int32) - image.min(axis=2)
        if float((spread > COLOUR_SPREAD).mean()) > COLOUR_PIXEL_SHARE:
            raise ImageError("not-xray", path, "colour image: looks like a photo, not a grayscale X-ray")
        image = cv2.cvtColor(image, cv2.COLOR_BGR2GRAY)
    if image.dtype != np.uint8:
        image = _to_uint8(image)
    return image


def load_gray(path: str | Path) -> np.ndarray:
    """Decode a PNG/JPEG/DICOM radiograph to a 2-D uint8 array, or raise ImageError."""
    path = Path(path)
    if not path.is_file():
        raise ImageError("missing", path, "file not found")
    gray = _load_dicom(path) if is_dicom(path) else _load_raster(path)
    if min(gray.shape[:2]) < 16:
        raise ImageError("unreadable", path, f"image too small ({gray.shape[1]}x{gray.shape[0]})")
    return gray


def resize_square(gray: np.ndarray, size: int) -> np.ndarray:
    return cv2.resize(gray, (size, size), interpolation=cv2.INTER_AREA)


def encode_png(gray: np.ndarray) -> bytes:
    ok, buffer = cv2.imencode(".png", gray)
    if not ok:
        raise ValueError("PNG encoding failed")
    return buffer.tobytes()


def model_input(path: str | Path, size: int) -> np.ndarray:
    """File -> (size, size, 1) float32, identical to what training read from the shards."""
    return resize_square(load_gray(path), size).astype(np.float32)[:, :, None]
