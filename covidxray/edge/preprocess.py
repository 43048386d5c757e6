"""Image decoding and resizing shared by `prepare` and `predict`.

Training and inference must see pixels made by exactly the same code, so this
module is the only place that turns a file into model input. It imports no
TensorFlow: `predict` on a Pi loads it beside the LiteRT interpreter only.
Model input is a float32 (size, size, 1) array of gray values 0..255; scaling
to 0..1 happens inside the model.
"""

from __future__ import annotations

import errno
import functools
import os
import warnings
from pathlib import Path

import cv2
import numpy as np

from covidxray.edge.harmonise import NONE, harmonised
from covidxray.edge.image_header import DEFAULT_MAX_PIXELS, OPENCV_PIXEL_LIMIT, declared_size
from covidxray.errors import reraise_interrupt
from covidxray.records import VOLUME_SUFFIXES

# Bump whenever a change to this module can change a single output pixel. Prepare's decode cache and shard
# names, the manifest, the model card and every sidecar carry it: a new version decodes afresh, and predict
# warns when a model was trained on pixels made by another version. What version 1 does:
#   decode: grayscale; DICOM: modality LUT (rescale slope/intercept), then VOI LUT sequence scaled from its
#     output range, else the first window (DICOM linear/sigmoid formula) to 0..255, else min-max;
#     MONOCHROME1 inverted; other 16-bit images min-max scaled to 8-bit
#   resize: cv2.INTER_AREA to size x size (aspect not kept)
#   input: float32 gray values 0..255, shape (size, size, 1); the model rescales
# data.harmonise (covidxray/edge/harmonise.py; manifest, card and sidecar name it) may change the pixels before
# the resize; its methods carry their own names, so version 1 with harmonise "none" is the pixels above.
PREPROCESSING_VERSION = 1

# Projection radiography (CR, DX, the common non-standard DR, RG) plus OT and no
# modality at all, which anonymised exports and secondary captures often carry.
# Everything else (CT, MR, US, NM, PT, SEG, RTDOSE...) is refused by name.
XRAY_MODALITIES = ("CR", "DX", "DR", "RG", "OT", "")

# A colour image counts as a photo, not an X-ray, when this share of its pixels
# has channels further apart than COLOUR_SPREAD gray levels (annotations and
# tinted scans stay well below it).
COLOUR_SPREAD = 40
COLOUR_PIXEL_SHARE = 0.05
# ... unless it is a tinted grayscale image (a journal figure printed in one colour): its coloured
# pixels share one hue (95% within TINT_HUE_SPREAD OpenCV hue units, i.e. 2 degrees each, of
# their mean) and each channel is a linear function of brightness (RMS residual at most
# TINT_RESIDUAL gray levels). A tinted ieee8023 film: 1.6 units and 2.1 levels; scikit-image's
# colour photos: at least 3.4 units (retina) and 9.0 levels (retina, ihc, chelsea); two flat
# colours lie on a line too but not on one hue.
TINT_HUE_SPREAD = 6.0
TINT_RESIDUAL = 4.0


# How to raise the limit, for a film that really is that large (every command takes --set, predict included).
RAISE_LIMIT_HINT = "if this board has the memory (e.g. --set data.max_pixels=40000000)"


class ImageError(ValueError):
    """A file that cannot become model input; `reason` is a short countable code.

    Reasons: missing, empty, unreadable, not-xray, unsupported, too-large.
    """

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
            head = handle.read(132)
    except OSError:
        return False
    return head[128:132] == b"DICM" or _starts_like_bare_dataset(head)


def _starts_like_bare_dataset(head: bytes) -> bool:
    """Whether a file begins like a DICOM data set written without preamble and file meta header.

    Old PACS exports (and PS3.10's predecessor, ACR-NEMA) start straight with the
    first element: group 0002 or 0008 (little or big endian), a small element
    number, then an explicit VR (two capital letters) or a 4-byte implicit length.
    No PNG/JPEG/BMP/TIFF signature starts that way; `_load_dicom` still checks
    that what follows parses into an image data set.
    """
    if len(head) < 8:
        return False
    for order in ("little", "big"):
        group, element = int.from_bytes(head[0:2], order), int.from_bytes(head[2:4], order)
        if group in (0x0002, 0x0008) and element < 0x0100:
            explicit_vr = head[4:6].isalpha() and head[4:6].isupper()
            return explicit_vr or int.from_bytes(head[4:8], order) < 0x10000
    return False


def _scale_to_uint8(values: np.ndarray, low: float, high: float) -> np.ndarray:
    """Map [low, high] linearly onto 0..255 (clipping outside), rounding to nearest."""
    if high <= low:
        return np.zeros(values.shape, np.uint8)
    scaled = (values.astype(np.float64) - low) * 255.0 / (high - low)  # product first: exact for integer values
    return np.round(np.clip(scaled, 0, 255)).astype(np.uint8)


def _to_uint8(pixels: np.ndarray) -> np.ndarray:
    """Min-max: the image's own darkest pixel becomes 0, its brightest 255."""
    return _scale_to_uint8(pixels, float(pixels.min()), float(pixels.max()))


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _first(value) -> float:
    """WindowCenter/Width may hold several alternatives; the first is the default one."""
    try:
        return float(value)
    except TypeError:
        return float(value[0])


def window_to_uint8(values: np.ndarray, center: float, width: float, function: str = "LINEAR") -> np.ndarray:
    """DICOM PS3.3 C.11.2.1.2 windowing with 0..255 as the output range."""
    values = values.astype(np.float64)
    if function == "SIGMOID":
        return np.round(255.0 / (1.0 + np.exp(-4.0 * (values - center) / width))).astype(np.uint8)
    if function == "LINEAR_EXACT":
        scaled = ((values - center) / width + 0.5) * 255.0
    else:  # LINEAR: the standard's half-pixel offsets
        scaled = ((values - (center - 0.5)) / (width - 1.0) + 0.5) * 255.0
    return np.round(np.clip(scaled, 0, 255)).astype(np.uint8)


def _window_of(dataset) -> tuple[float, float, str] | None:
    if "WindowCenter" not in dataset or "WindowWidth" not in dataset:
        return None
    function = str(dataset.get("VOILUTFunction", "LINEAR") or "LINEAR").upper()
    center, width = _first(dataset.WindowCenter), _first(dataset.WindowWidth)
    if width < (1.0 if function == "LINEAR" else 1e-6):
        return None  # an invalid window is treated as none at all
    return center, width, function


def voi_lut_to_uint8(values: np.ndarray, item, dataset) -> np.ndarray:
    """Apply a VOI LUT Sequence item and scale its output range to 0..255.

    Done here rather than with pydicom's apply_voi, which wraps indices above 255
    for 8-bit LUTs (pydicom 3.0). The output range is the LUT's own min..max, as
    LUT Descriptor bit depths are often wrong in the wild.
    """
    entries, first = int(item.LUTDescriptor[0]) or 65536, int(item.LUTDescriptor[1])
    if int(dataset.get("PixelRepresentation", 0)) == 1 and first > 32767:
        first -= 65536  # the descriptor is stored unsigned even for signed pixel data
    data = item.LUTData
    if isinstance(data, bytes):
        little_endian = getattr(dataset, "original_encoding", (None, True))[1] is not False
        table = np.frombuffer(data, dtype="<u2" if little_endian else ">u2").astype(np.float64)
    else:
        table = np.asarray(data, dtype=np.float64).ravel()
    table = table[:entries]
    index = np.clip(np.round(values) - first, 0, len(table) - 1).astype(np.int64)
    return _scale_to_uint8(table[index], float(table.min()), float(table.max()))


def _decode_failure(dataset, path: Path | str, err: Exception) -> ImageError:
    """'unsupported' when no installed plugin decodes the transfer syntax, else 'unreadable' (bad data)."""
    from pydicom.pixels import get_decoder

    syntax = dataset.file_meta.get("TransferSyntaxUID") if hasattr(dataset, "file_meta") else None
    if syntax is not None:
        try:
            available = get_decoder(syntax).is_available
        except NotImplementedError:  # a transfer syntax pydicom has no decoder for at all
            available = False
        if not available:
            return ImageError(
                "unsupported",
                path,
                f"no DICOM pixel decoder installed for {syntax.name} ({syntax}); "
                "install covidxray's pylibjpeg dependencies (pip install pylibjpeg pylibjpeg-libjpeg pylibjpeg-openjpeg pylibjpeg-rle)",
            )
    return ImageError("unreadable", path, f"cannot decode DICOM pixels ({_one_line(err)})")


def dicom_gray(dataset, path: Path | str = "<dataset>") -> np.ndarray:
    """Stored DICOM pixels -> 2-D uint8 display values (modality LUT, VOI, MONOCHROME1 inversion).

    No modality check here, so pydicom's own CT/MR test files can exercise it.
    """
    from pydicom.pixels import apply_modality_lut

    photometric = str(dataset.get("PhotometricInterpretation", "MONOCHROME2")).upper()
    if photometric not in ("MONOCHROME1", "MONOCHROME2"):
        raise ImageError(
            "not-xray", path, f"DICOM photometric interpretation {photometric} is not a grayscale radiograph"
        )
    bits = int(dataset.get("BitsAllocated", 16) or 16)
    if bits not in (8, 16):
        raise ImageError("unsupported", path, f"DICOM with {bits}-bit pixels: radiographs here are 8 to 16 bit")
    try:
        pixels = dataset.pixel_array
    except Exception as err:  # pydicom raises many types for truncated data or missing codecs
        reraise_interrupt(err)
        raise _decode_failure(dataset, path, err) from None
    if pixels.ndim != 2:
        raise ImageError("not-xray", path, f"DICOM pixel array of shape {pixels.shape} is not a single gray image")
    values = apply_modality_lut(pixels, dataset)
    window = _window_of(dataset)
    if dataset.get("VOILUTSequence"):
        gray = voi_lut_to_uint8(values, dataset.VOILUTSequence[0], dataset)
    elif window is not None:
        gray = window_to_uint8(values, *window)
    else:
        gray = _to_uint8(values)
    # Photometric Interpretation alone decides the polarity; Presentation LUT Shape is not applied.
    # With MONOCHROME1 it names the same inversion (DX requires INVERSE exactly when the data is
    # MONOCHROME1), so applying both shows the radiograph negative (a known viewer bug: Weasis 4.0.3,
    # nroduit/Weasis#372). With MONOCHROME2 it is known to be wrong in real DX/CR objects, which
    # is why dcm4chee lets PACS ignore it (dcm4chee-arc-light#3155).
    return 255 - gray if photometric == "MONOCHROME1" else gray


# What a data set read without file meta header must hold to be taken for a radiograph file
# rather than bytes that merely start like one (pydicom's force=True parses almost anything).
_BARE_DATASET_NEEDS = ("Rows", "Columns", "BitsAllocated", "PixelData")


def _read_bare_dataset(path: Path):
    """A data set with no preamble and no file meta header, or ImageError when it is not one."""
    import pydicom
    from pydicom.uid import UID, ExplicitVRBigEndian, ExplicitVRLittleEndian, ImplicitVRLittleEndian

    not_dicom = "not a DICOM file (no DICOM preamble and file meta header, and not a bare DICOM image data set)"
    try:
        with warnings.catch_warnings():  # junk parsed by force=True warns about made-up charsets and VRs
            warnings.simplefilter("ignore")
            dataset = pydicom.dcmread(str(path), force=True)
        complete = (
            all(name in dataset for name in _BARE_DATASET_NEEDS) and int(dataset.Rows) > 0 and int(dataset.Columns) > 0
        )
    except Exception:  # force=True on junk fails in many ways (bad lengths, undecodable values)
        raise ImageError("unreadable", path, not_dicom) from None
    if not complete:
        raise ImageError("unreadable", path, not_dicom)
    if dataset["PixelData"].is_undefined_length:
        raise ImageError(
            "unsupported",
            path,
            "compressed DICOM pixel data without a file meta header: its transfer syntax is unknown",
        )
    # Native pixels are read with the encoding the elements were found in.
    # original_encoding is (is_implicit_VR, is_little_endian), each None when the elements never said
    syntax: dict[tuple[bool | None, ...], UID] = {
        (True, True): ImplicitVRLittleEndian,
        (False, True): ExplicitVRLittleEndian,
        (False, False): ExplicitVRBigEndian,
    }
    dataset.file_meta.TransferSyntaxUID = syntax.get(tuple(dataset.original_encoding), ImplicitVRLittleEndian)
    return dataset


def _load_dicom(path: Path) -> np.ndarray:
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        dataset = pydicom.dcmread(str(path))
    except InvalidDicomError:
        dataset = _read_bare_dataset(path)
    except (OSError, EOFError, ValueError, KeyError) as err:
        raise ImageError("unreadable", path, f"not a readable DICOM file ({_one_line(err)})") from None
    if "PixelData" not in dataset:
        raise ImageError("unreadable", path, "DICOM file holds no pixel data")
    modality = str(dataset.get("Modality", "") or "").upper()
    if modality not in XRAY_MODALITIES:
        raise ImageError(
            "not-xray",
            path,
            f"DICOM modality {modality} is not a radiograph (expected {', '.join(m for m in XRAY_MODALITIES if m)})",
        )
    frames = int(dataset.get("NumberOfFrames", 1) or 1)
    if frames > 1:
        raise ImageError("not-xray", path, f"DICOM with {frames} frames is a volume or series, not a radiograph")
    return dicom_gray(dataset, path)


def _is_tinted_gray(image: np.ndarray, coloured: np.ndarray) -> bool:
    """Whether a colour image is one gray image printed in a single tint (see TINT_HUE_SPREAD)."""
    eight_bit = image if image.dtype == np.uint8 else (image // 257).astype(np.uint8)
    hue = cv2.cvtColor(eight_bit, cv2.COLOR_BGR2HSV)[..., 0][coloured] * (np.pi / 90)  # OpenCV hue 0..180 -> radians
    mean_hue = np.angle(np.exp(1j * hue).mean())
    if np.percentile(np.abs(np.angle(np.exp(1j * (hue - mean_hue)))), 95) * (90 / np.pi) > TINT_HUE_SPREAD:
        return False
    channels = eight_bit.reshape(-1, 3).astype(np.float64)
    brightness = np.stack([channels.mean(axis=1), np.ones(len(channels))], axis=1)
    fit, *_ = np.linalg.lstsq(brightness, channels, rcond=None)
    return float(np.sqrt(((channels - brightness @ fit) ** 2).mean())) <= TINT_RESIDUAL


def _channel_spread(image: np.ndarray) -> np.ndarray:
    """Per pixel, its largest channel minus its smallest: the values of `image.max(axis=2).astype(np.int32) -
    image.min(axis=2)`, for every dtype imdecode returns.

    numpy's reduction over the short channel axis took 13 ms for a 768 px RGB film, element-wise maximum and minimum
    over the channel planes take 0.7. Unsigned images skip the int32 cast, which would double that: their maximum is
    never below their minimum, so the difference cannot wrap. Signed and float images keep it, and with it the
    truncation of a float maximum.
    """
    channels = [image[:, :, index] for index in range(image.shape[2])]
    highest, lowest = functools.reduce(np.maximum, channels), functools.reduce(np.minimum, channels)
    return highest - lowest if image.dtype.kind == "u" else highest.astype(np.int32) - lowest


def _load_raster(path: Path, max_pixels: int) -> np.ndarray:
    try:
        data = np.fromfile(str(path), dtype=np.uint8)
    except OSError as err:
        raise ImageError("unreadable", path, f"cannot read the file ({err.strerror or err})") from None
    if data.size == 0:
        raise ImageError("empty", path, "file is empty")
    try:
        image = cv2.imdecode(data, cv2.IMREAD_UNCHANGED)
    except cv2.error as err:  # OpenCV's own size limit (OPENCV_IO_MAX_IMAGE_PIXELS), for a size no header check found
        if "CV_IO_MAX_IMAGE" not in str(err):
            raise ImageError("unreadable", path, f"not a decodable image ({_one_line(err)})") from None
        raise ImageError(
            "too-large",
            path,
            f"decoding was refused by OpenCV's pixel limit ({OPENCV_PIXEL_LIMIT}={os.environ.get(OPENCV_PIXEL_LIMIT, 'default')}): "
            f"the image is larger than data.max_pixels {max_pixels:,} allows; downscale it, or raise data.max_pixels {RAISE_LIMIT_HINT}",
        ) from None
    if image is None or image.size == 0:
        raise ImageError("unreadable", path, "not a decodable image (corrupt, truncated or not an image)")
    if image.ndim == 3:
        if image.shape[2] == 4:
            image = image[:, :, :3]
        levels = COLOUR_SPREAD * (257 if image.dtype == np.uint16 else 1)
        coloured = _channel_spread(image) > levels
        if float(coloured.mean()) > COLOUR_PIXEL_SHARE and not _is_tinted_gray(image, coloured):
            raise ImageError("not-xray", path, "colour image: looks like a photo, not a grayscale X-ray")
        image = cv2.cvtColor(image, cv2.COLOR_BGR2GRAY)
    if image.dtype != np.uint8:
        image = _to_uint8(image)
    return image


def _check_pixel_count(path: Path, size: tuple[int, int] | None, max_pixels: int, what: str) -> None:
    if size is not None and size[0] * size[1] > max_pixels:
        raise ImageError(
            "too-large",
            path,
            f"{what} {size[0]}x{size[1]} = {size[0] * size[1]:,} pixels, above data.max_pixels "
            f"{max_pixels:,} (decoding it could exhaust memory); downscale it, or raise data.max_pixels {RAISE_LIMIT_HINT}",
        )


def _why_not_a_file(path: Path) -> str:
    if not path.is_symlink():
        return "file not found"
    target = os.readlink(path)
    try:
        path.resolve(strict=True)
    except RuntimeError:  # Python 3.11 reports a symlink loop as RuntimeError, later versions as ELOOP
        return f"a link in a loop (it points to {target})"
    except OSError as err:
        if err.errno == errno.ELOOP:
            return f"a link in a loop (it points to {target})"
        return f"a broken link: it points to {target}, which {'does not exist' if err.errno == errno.ENOENT else err.strerror}"
    return f"a link to {target}, which is not a file"


def load_gray(path: str | Path, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Decode a PNG/JPEG/DICOM radiograph to a 2-D uint8 array, or raise ImageError."""
    path = Path(path)
    if not path.is_file():
        raise ImageError("missing", path, _why_not_a_file(path))
    if path.name.lower().endswith(VOLUME_SUFFIXES):
        raise ImageError("not-xray", path, "a 3-D volume file (CT/MR), not a radiograph")
    dicom = is_dicom(path)
    _check_pixel_count(path, declared_size(path, dicom), max_pixels, "header declares")
    if dicom:
        try:
            gray = _load_dicom(path)
        except ImageError:
            raise
        except Exception as err:  # malformed data sets fail inside pydicom in many ways: that file's problem only
            reraise_interrupt(err)
            raise ImageError(
                "unreadable", path, f"cannot decode DICOM ({type(err).__name__}: {_one_line(err)})"
            ) from None
    else:
        gray = _load_raster(path, max_pixels)
    _check_pixel_count(
        path, (gray.shape[1], gray.shape[0]), max_pixels, "decodes to"
    )  # formats whose header is not parsed
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


def model_pixels(gray: np.ndarray, size: int, harmonise: str = NONE) -> np.ndarray:
    """Decoded gray image -> the size x size uint8 image a shard holds: harmonised (data.harmonise), then resized."""
    return resize_square(harmonised(gray, harmonise, size), size)


def as_model_input(gray: np.ndarray, size: int, harmonise: str = NONE) -> np.ndarray:
    """Decoded gray image -> (size, size, 1) float32, identical to what training read from the shards."""
    return model_pixels(gray, size, harmonise).astype(np.float32)[:, :, None]


def model_input(path: str | Path, size: int) -> np.ndarray:
    return as_model_input(load_gray(path), size)
