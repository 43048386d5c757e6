"""Issue 5: the one decode path for training and predict (PNG, JPEG, DICOM) and its refusals.

Expected pixels are computed here from the raw values with the DICOM formulas
written out independently, not by calling the code under test.
"""

from __future__ import annotations

import csv

import cv2
import numpy as np
import pydicom
import pytest
from pydicom.data import get_testdata_file
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, generate_uid

from covidxray.edge.preprocess import ImageError, dicom_gray, load_gray, model_input


def pydicom_file(name: str) -> str:
    """One of pydicom's bundled test files; never one it would download (no network here)."""
    path = get_testdata_file(name, download=False)
    if path is None:
        pytest.skip(f"{name} is not bundled with this pydicom")
    return path


def write_dicom(path, pixels: np.ndarray, modality: str = "DX", photometric: str = "MONOCHROME2", **attributes):
    """A minimal single-frame DICOM file holding `pixels` (uint8/uint16/int16) as stored values."""
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.1.1"  # Digital X-Ray Image Storage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
    ds.Modality, ds.PatientID = modality, "TEST"
    ds.Rows, ds.Columns = pixels.shape[:2]
    ds.SamplesPerPixel = 1 if pixels.ndim == 2 else pixels.shape[2]
    ds.PhotometricInterpretation = photometric
    ds.BitsAllocated = pixels.dtype.itemsize * 8
    ds.BitsStored = attributes.pop("BitsStored", ds.BitsAllocated)
    ds.HighBit = ds.BitsStored - 1
    ds.PixelRepresentation = 1 if pixels.dtype.kind == "i" else 0
    if pixels.ndim == 3:
        ds.PlanarConfiguration = 0
    for key, value in attributes.items():
        setattr(ds, key, value)
    ds.PixelData = np.ascontiguousarray(pixels).tobytes()
    ds.save_as(str(path), enforce_file_format=True)
    return path


def min_max(values: np.ndarray) -> np.ndarray:
    values = values.astype(np.float64)
    return np.round((values - values.min()) * 255 / (values.max() - values.min())).astype(np.uint8)


def linear_window(values: np.ndarray, center: float, width: float) -> np.ndarray:
    """DICOM PS3.3 C.11.2.1.2.1 'LINEAR', written case by case as the standard states it."""
    x = values.astype(np.float64)
    low, high = center - 0.5 - (width - 1) / 2, center - 0.5 + (width - 1) / 2
    inside = ((x - (center - 0.5)) / (width - 1) + 0.5) * 255
    return np.round(np.where(x <= low, 0, np.where(x > high, 255, inside))).astype(np.uint8)


# --- pydicom's own test files ---------------------------------------------------------------


def test_bundled_secondary_capture_is_min_max_scaled_stored_pixels():
    path = pydicom_file("image_dfl.dcm")  # OT, MONOCHROME2, 8-bit, deflated transfer syntax, no window
    raw = pydicom.dcmread(path).pixel_array
    assert np.array_equal(load_gray(path), min_max(raw))


def test_bundled_mr_window_follows_the_dicom_linear_formula():
    ds = pydicom.dcmread(pydicom_file("MR_small.dcm"))  # 16-bit signed, window 600/1600, no rescale
    expected = linear_window(ds.pixel_array, float(ds.WindowCenter), float(ds.WindowWidth))
    assert np.array_equal(dicom_gray(ds), expected)
    assert len(np.unique(expected)) > 50  # the window really spans the image's values


@pytest.mark.parametrize(
    "variant",
    [
        "MR_small_bigendian.dcm",
        "MR_small_implicit.dcm",
        "MR_small_RLE.dcm",
        "MR_small_jp2klossless.dcm",
        "MR_small_padded.dcm",
        "MR_small_jpeg_ls_lossless.dcm",
    ],
)
def test_every_transfer_syntax_decodes_to_the_same_pixels(variant):
    reference = dicom_gray(pydicom.dcmread(pydicom_file("MR_small.dcm")))
    assert np.array_equal(dicom_gray(pydicom.dcmread(pydicom_file(variant))), reference)


@pytest.mark.parametrize(
    "name, says",
    [
        ("CT_small.dcm", "modality CT"),
        ("MR_small.dcm", "modality MR"),
        ("rtdose.dcm", "modality RTDOSE"),  # also 15 frames
        ("liver_1frame.dcm", "modality SEG"),
        ("examples_rgb_color.dcm", "modality US"),
    ],
)
def test_bundled_non_radiographs_are_refused(name, says):
    with pytest.raises(ImageError) as caught:
        load_gray(pydicom_file(name))
    assert caught.value.reason == "not-xray" and says in caught.value.detail


def test_bundled_file_without_dicom_header_is_unreadable():
    with pytest.raises(ImageError) as caught:
        load_gray(pydicom_file("no_meta.dcm"))
    assert caught.value.reason == "unreadable" and "not a DICOM file" in caught.value.detail


# --- generated DICOMs -------------------------------------------------------------------------


def test_monochrome1_16bit_applies_rescale_then_window_then_inverts(tmp_path):
    stored = np.arange(64 * 64, dtype=np.uint16).reshape(64, 64)  # 0..4095: 12 bits stored
    slope, intercept, center, width = 2.0, -1000.0, 1000.0, 2001.0
    path = write_dicom(
        tmp_path / "mono1.dcm",
        stored,
        photometric="MONOCHROME1",
        BitsStored=12,
        RescaleSlope=slope,
        RescaleIntercept=intercept,
        WindowCenter=center,
        WindowWidth=width,
    )
    expected = 255 - linear_window(stored * slope + intercept, center, width)
    gray = load_gray(path)
    assert np.array_equal(gray, expected)
    # MONOCHROME1: low values are white. Values below the window are 255, above it 0.
    assert gray[0, 0] == 255 and gray[-1, -1] == 0
    assert np.all(np.diff(gray.ravel().astype(int)) <= 0)


@pytest.mark.parametrize(
    "photometric, shape", [("MONOCHROME1", "INVERSE"), ("MONOCHROME1", "IDENTITY"), ("MONOCHROME2", "INVERSE")]
)
def test_photometric_interpretation_alone_sets_the_polarity(tmp_path, photometric, shape):
    """MONOCHROME1 + INVERSE is one inversion, not two; INVERSE on MONOCHROME2 is not trusted."""
    stored = np.arange(32 * 32, dtype=np.uint16).reshape(32, 32)
    path = write_dicom(tmp_path / "shape.dcm", stored, photometric=photometric, PresentationLUTShape=shape)
    expected = min_max(stored)
    assert np.array_equal(load_gray(path), 255 - expected if photometric == "MONOCHROME1" else expected)


def test_monochrome2_8bit_without_window_is_min_max(tmp_path):
    rng = np.random.default_rng(0)
    stored = rng.integers(30, 200, size=(40, 50), dtype=np.uint8)
    path = write_dicom(tmp_path / "mono2.dcm", stored)
    gray = load_gray(path)
    assert np.array_equal(gray, min_max(stored))
    assert gray.min() == 0 and gray.max() == 255


def test_multiple_windows_use_the_first(tmp_path):
    stored = np.linspace(0, 4000, 32 * 32).astype(np.uint16).reshape(32, 32)
    path = write_dicom(tmp_path / "two-windows.dcm", stored, WindowCenter=[1500, 3000], WindowWidth=[1000, 400])
    assert np.array_equal(load_gray(path), linear_window(stored, 1500, 1000))


@pytest.mark.parametrize("vr", ["US", "OW"])  # LUT Data may be stored either way
def test_voi_lut_sequence_beyond_256_entries_is_applied_exactly(tmp_path, vr):
    stored = np.linspace(0, 5000, 48 * 48).astype(np.uint16).reshape(48, 48)
    table = (np.sqrt(np.arange(4096) / 4095) * 200 + 20).astype(np.uint16)  # 8-bit values, 4096 entries
    item = Dataset()
    item.LUTDescriptor = [4096, 0, 8]
    item.add_new(0x00283006, vr, table.tolist() if vr == "US" else table.astype("<u2").tobytes())  # LUT Data
    path = write_dicom(tmp_path / "voi.dcm", stored, VOILUTSequence=[item], WindowCenter=100, WindowWidth=10)
    looked_up = table[np.clip(stored, 0, 4095)].astype(np.float64)  # the LUT wins over the window
    expected = np.round((looked_up - table.min()) * 255 / (table.max() - table.min())).astype(np.uint8)
    assert np.array_equal(load_gray(path), expected)


def test_signed_pixels_with_sigmoid_window(tmp_path):
    stored = np.linspace(-2000, 2000, 32 * 32).astype(np.int16).reshape(32, 32)
    path = write_dicom(tmp_path / "sigmoid.dcm", stored, WindowCenter=0, WindowWidth=800, VOILUTFunction="SIGMOID")
    expected = np.round(255 / (1 + np.exp(-4 * stored.astype(np.float64) / 800))).astype(np.uint8)
    assert np.array_equal(load_gray(path), expected)


@pytest.mark.parametrize(
    "pixels, attributes, says",
    [
        (np.zeros((3 * 32, 32), np.uint16), {"NumberOfFrames": 3, "Rows": 32}, "3 frames"),
        (np.zeros((32, 32, 3), np.uint8), {"photometric": "RGB"}, "photometric interpretation RGB"),
        (np.zeros((32, 32), np.uint16), {"modality": "CT"}, "modality CT"),
    ],
)
def test_generated_non_radiographs_are_refused(tmp_path, pixels, attributes, says):
    path = write_dicom(tmp_path / "bad.dcm", pixels, **attributes)
    with pytest.raises(ImageError) as caught:
        load_gray(path)
    assert caught.value.reason == "not-xray" and says in caught.value.detail


def test_truncated_pixel_data_is_unreadable(tmp_path):
    path = write_dicom(tmp_path / "short.dcm", np.zeros((64, 64), np.uint16))
    ds = pydicom.dcmread(path)
    ds.PixelData = ds.PixelData[:1000]
    ds.save_as(str(path))
    with pytest.raises(ImageError) as caught:
        load_gray(path)
    assert caught.value.reason == "unreadable" and "cannot decode DICOM pixels" in caught.value.detail


def test_dicom_without_suffix_is_recognised_by_its_preamble(tmp_path):
    stored = np.arange(32 * 32, dtype=np.uint16).reshape(32, 32)
    write_dicom(tmp_path / "IM0001.dcm", stored)
    (tmp_path / "IM0001.dcm").rename(tmp_path / "IM0001")
    assert np.array_equal(load_gray(tmp_path / "IM0001"), min_max(stored))


@pytest.mark.parametrize("implicit_vr, little_endian", [(True, True), (False, True), (False, False)])
def test_bare_data_set_without_preamble_or_file_meta_is_read(tmp_path, implicit_vr, little_endian):
    """Old PACS exports: the data set alone, no 128-byte preamble, no 'DICM', no (0002) group."""
    stored = np.arange(40 * 48, dtype=np.uint16).reshape(40, 48) * 3
    ds = pydicom.dcmread(write_dicom(tmp_path / "full.dcm", stored, modality="CR", photometric="MONOCHROME1"))
    del ds.file_meta
    ds.preamble = None
    ds.PixelData = stored.astype("<u2" if little_endian else ">u2").tobytes()  # dcmwrite does not byte-swap pixels
    pydicom.dcmwrite(
        tmp_path / "IM0001", ds, implicit_vr=implicit_vr, little_endian=little_endian, enforce_file_format=False
    )
    assert (tmp_path / "IM0001").read_bytes()[:2] in (b"\x08\x00", b"\x00\x08")  # really starts with the data set
    assert np.array_equal(load_gray(tmp_path / "IM0001"), 255 - min_max(stored))


@pytest.mark.parametrize("suffix", ["", ".dcm"])
def test_junk_that_starts_like_a_bare_data_set_is_not_taken_for_dicom(tmp_path, suffix):
    rng = np.random.default_rng(1)
    path = tmp_path / f"junk{suffix}"
    path.write_bytes(b"\x08\x00\x05\x00\x10\x00\x00\x00" + rng.integers(0, 256, 4000, dtype=np.uint8).tobytes())
    with pytest.raises(ImageError) as caught:
        load_gray(path)
    assert caught.value.reason == "unreadable" and "not a DICOM file" in caught.value.detail


def test_transfer_syntax_without_any_decoder_is_unsupported(tmp_path):
    from pydicom.encaps import encapsulate

    path = write_dicom(tmp_path / "mpeg.dcm", np.zeros((32, 32), np.uint8))
    ds = pydicom.dcmread(path)
    ds.file_meta.TransferSyntaxUID = "1.2.840.10008.1.2.4.100"  # MPEG2 video: no pixel decoder exists for it
    ds.PixelData = encapsulate([b"\x00" * 64])
    ds["PixelData"].VR = "OB"
    ds.save_as(str(path))
    with pytest.raises(ImageError) as caught:
        load_gray(path)
    assert caught.value.reason == "unsupported" and "MPEG2" in caught.value.detail


# --- real DICOM: ../shared/data/dicom and the pydicom-data originals ---------------------------

# What each shared file is, from its provenance (shared/data/README.md), not from the decoder:
# a chest radiograph shown the standard way (lungs dark), the MONOCHROME2 pixels retagged
# MONOCHROME1 (the tag says "invert", so it must show inverted: lungs bright), or a refusal.
SHARED_DICOM = {
    "CR-MONO1-10-chest": "lungs dark",  # no preamble, no file meta: a bare implicit-VR data set
    "CR-MONO1-15bit-j2k-RG1_J2KI.dcm": "lungs dark",
    "CR-MONO1-15bit-jpegls-RG1_JLSN.dcm": "lungs dark",
    "CR-MONO2-8bit-rsna.dcm": "lungs dark",
    "CR-MONO2-8bit-siim.dcm": "lungs dark",
    "CR-fake-MONO1-retagged-MONO2-pixels.dcm": "lungs bright",
    "DX-MONO1-12bit-INVERSE-j2k-966_fixed.dcm": "lungs dark",  # MONOCHROME1 + Presentation LUT Shape INVERSE
    "DX-MONO2-8bit-nhsx.dcm": "lungs dark",
    "CT-abdomen-not-xray.dcm": ("not-xray", "modality CT"),
}


def mediastinum_minus_lungs(gray: np.ndarray) -> float:
    """Mean gray of the central mediastinum strip minus that of both mid lung fields.

    A frontal chest radiograph shown the standard way has air-filled lungs dark and the
    mediastinum/spine bright, so this is clearly positive; shown inverted, clearly negative.
    Regions in % of the image: rows 30-60, lungs at columns 18-35 and 65-82, mediastinum 45-55.
    """
    small = cv2.resize(gray, (100, 100), interpolation=cv2.INTER_AREA).astype(np.float64)
    lungs = np.concatenate([small[30:60, 18:35].ravel(), small[30:60, 65:82].ravel()])
    return float(small[30:60, 45:55].mean() - lungs.mean())


def test_the_shared_dicom_table_lists_every_file(shared_data):
    assert sorted(p.name for p in (shared_data / "dicom").iterdir()) == sorted(SHARED_DICOM)


@pytest.mark.parametrize("name", sorted(SHARED_DICOM))
def test_every_shared_dicom_file_decodes_or_is_refused_for_its_reason(shared_data, name):
    expected = SHARED_DICOM[name]
    path = shared_data / "dicom" / name
    if isinstance(expected, tuple):
        reason, says = expected
        with pytest.raises(ImageError) as caught:
            load_gray(path)
        assert caught.value.reason == reason and says in caught.value.detail
        return
    gray = load_gray(path)
    assert gray.dtype == np.uint8 and min(gray.shape) >= 256 and gray.std() > 20
    # Lungs differ from the mediastinum by 31..104 gray levels in these files; 20 leaves margin both ways.
    contrast = mediastinum_minus_lungs(gray)
    assert contrast > 20 if expected == "lungs dark" else contrast < -20, contrast


def test_bare_cr_file_equals_its_raw_pixels_windowed_by_hand(shared_data):
    """CR-MONO1-10-chest: 440x440 16-bit little-endian stored values are the file's last bytes (PixelData
    is its last element); window 550/1024 from its header; MONOCHROME1, so inverted."""
    raw = (shared_data / "dicom" / "CR-MONO1-10-chest").read_bytes()
    stored = np.frombuffer(raw[-440 * 440 * 2 :], "<u2").reshape(440, 440)
    assert np.array_equal(
        load_gray(shared_data / "dicom" / "CR-MONO1-10-chest"), 255 - linear_window(stored, 550, 1024)
    )


def pydicom_data_file(name: str) -> str:
    """One of the pydicom-data package's files (the dev extra installs it); skipped without it."""
    path = get_testdata_file(name, download=False)
    if path is None:
        pytest.skip(f"{name}: install the dev extra (pydicom-data)")
    return path


def rg1_original() -> np.ndarray:
    """RG1 (a 15-bit MONOCHROME1 chest CR) as acquired: UNCR is the uncompressed original of the
    compression samples, UNCI the published decompression of the irreversible J2KI."""
    return pydicom.dcmread(pydicom_data_file("RG1_UNCR.dcm")).pixel_array.astype(np.int64)


def test_rg1_reversible_jpeg2000_is_pixel_exact():
    original = rg1_original()
    lossless = pydicom.dcmread(pydicom_data_file("RG1_J2KR.dcm"))
    assert np.array_equal(lossless.pixel_array, original)
    assert np.array_equal(load_gray(pydicom_data_file("RG1_J2KR.dcm")), load_gray(pydicom_data_file("RG1_UNCR.dcm")))


def jpeg_ls_near(frame: bytes) -> int:
    """NEAR of a JPEG-LS scan, read from its SOS header: length, Ns, Ns x (Ci, Tmi), then NEAR."""
    sos = frame.index(b"\xff\xda")
    components = frame[sos + 4]
    return frame[sos + 5 + 2 * components]


def test_rg1_near_lossless_jpeg_ls_stays_within_its_near_bound(shared_data):
    from pydicom.encaps import generate_frames

    original = rg1_original()
    ds = pydicom.dcmread(shared_data / "dicom" / "CR-MONO1-15bit-jpegls-RG1_JLSN.dcm")
    near = jpeg_ls_near(next(generate_frames(ds.PixelData, number_of_frames=1)))
    assert near > 0  # really near-lossless, so the bound below is the codec's promise, not equality
    assert np.abs(ds.pixel_array.astype(np.int64) - original).max() <= near
    # Displayed: the 30000-wide window puts ~118 stored values in one gray level, so at most 1 level apart.
    shown = load_gray(shared_data / "dicom" / "CR-MONO1-15bit-jpegls-RG1_JLSN.dcm").astype(int)
    assert np.abs(shown - load_gray(pydicom_data_file("RG1_UNCR.dcm"))).max() <= 1


def test_rg1_irreversible_jpeg2000_decodes_as_published_and_close_to_the_original(shared_data):
    ds = pydicom.dcmread(shared_data / "dicom" / "CR-MONO1-15bit-j2k-RG1_J2KI.dcm")
    assert np.array_equal(ds.pixel_array, pydicom.dcmread(pydicom_data_file("RG1_UNCI.dcm")).pixel_array)
    error = ds.pixel_array.astype(np.int64) - rg1_original()
    # Lossy, but the loss stays below one displayed gray level (window width / 255) on average.
    assert 0 < np.sqrt(np.mean(error.astype(np.float64) ** 2)) < float(ds.WindowWidth) / 255


def test_jpeg_lossless_decodes_like_opencv():
    """Process 14 (JPEG lossless, first-order prediction): OpenCV's libjpeg-turbo is an independent decoder."""
    from pydicom.encaps import generate_frames

    ds = pydicom.dcmread(pydicom_data_file("JPGLosslessP14SV1_1s_1f_8b.dcm"))
    frame = next(generate_frames(ds.PixelData, number_of_frames=1))
    reference = cv2.imdecode(np.frombuffer(frame, np.uint8), cv2.IMREAD_UNCHANGED)
    assert reference is not None and np.array_equal(ds.pixel_array, reference)


# --- rasters ----------------------------------------------------------------------------------


def test_16bit_png_is_min_max_scaled(tmp_path):
    stored = np.linspace(1000, 40000, 40 * 40).astype(np.uint16).reshape(40, 40)
    cv2.imwrite(str(tmp_path / "deep.png"), stored)
    assert np.array_equal(load_gray(tmp_path / "deep.png"), min_max(stored))


def test_gray_saved_as_rgb_equals_the_gray_image(tmp_path):
    gray = np.tile(np.arange(0, 256, 4, dtype=np.uint8), (64, 1))
    cv2.imwrite(str(tmp_path / "gray.png"), gray)
    cv2.imwrite(str(tmp_path / "rgb.png"), cv2.cvtColor(gray, cv2.COLOR_GRAY2BGR))
    assert np.array_equal(load_gray(tmp_path / "rgb.png"), gray)
    assert np.array_equal(load_gray(tmp_path / "gray.png"), gray)


def test_jpeg_decodes_to_gray(tmp_path):
    gray = np.tile(np.arange(0, 256, 4, dtype=np.uint8), (64, 1))
    cv2.imwrite(str(tmp_path / "x.jpg"), gray, [cv2.IMWRITE_JPEG_QUALITY, 100])
    decoded = load_gray(tmp_path / "x.jpg")
    assert decoded.shape == gray.shape and np.abs(decoded.astype(int) - gray).max() <= 3


@pytest.mark.parametrize(
    "name, content, reason",
    [
        ("empty.png", b"", "empty"),
        ("broken.png", b"\x89PNG\r\n\x1a\n not really", "unreadable"),
        ("notes.txt", b"clinical notes, not an image", "unreadable"),
        ("volume.nii.gz", b"\x1f\x8b whatever", "not-xray"),
        ("fake.dcm", b"plain text with a .dcm name", "unreadable"),
    ],
)
def test_bad_files_get_a_reason(tmp_path, name, content, reason):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ImageError) as caught:
        load_gray(tmp_path / name)
    assert caught.value.reason == reason and name in str(caught.value)


def test_colour_photo_and_missing_and_tiny_files_are_refused(tmp_path):
    photo = np.zeros((64, 64, 3), np.uint8)
    photo[:, :32] = (0, 0, 255)
    photo[:, 32:] = (0, 200, 0)
    cv2.imwrite(str(tmp_path / "photo.png"), photo)
    cv2.imwrite(str(tmp_path / "tiny.png"), np.zeros((8, 8), np.uint8))
    for name, reason in (("photo.png", "not-xray"), ("absent.png", "missing"), ("tiny.png", "unreadable")):
        with pytest.raises(ImageError) as caught:
            load_gray(tmp_path / name)
        assert caught.value.reason == reason, name


def numpy_channel_spread(image: np.ndarray) -> np.ndarray:
    """The colour check's spread as it was first written: numpy's reduction over the channel axis."""
    return image.max(axis=2).astype(np.int32) - image.min(axis=2)


def colour_images_of_every_decoded_dtype() -> list[np.ndarray]:
    """What imdecode hands the colour check (TIFF, JPEG 2000, HDR and PFM decode to all of these dtypes), at the
    extremes of each: signed ones span more than their own range, float ones hold NaN, infinities and fractions."""
    rng = np.random.default_rng(0)
    images = []
    for dtype in (np.uint8, np.uint16, np.int8, np.int16):
        info = np.iinfo(dtype)
        images.append(rng.integers(info.min, info.max, (40, 50, 3), dtype, endpoint=True))
        images[-1][0, :3] = [[info.min, info.max, 0], [info.max, info.min, info.max], [info.min, info.min, info.min]]
    for dtype in (np.float32, np.float64):
        floats = rng.uniform(-70000, 70000, (40, 50, 3)).astype(dtype)
        floats[0, :4] = [[np.nan, 1, 2], [np.inf, 0, 0], [-np.inf, 3.5, -0.0], [40.9, 0.5, 0.2]]
        images += [floats, (floats / 70000).astype(dtype)]  # 0..1 floats, as an HDR decodes
    return images


def test_channel_spread_equals_numpy_reduction_for_every_decoded_dtype():
    from covidxray.edge.preprocess import _channel_spread

    for image in colour_images_of_every_decoded_dtype():
        with np.errstate(invalid="ignore"):  # NaN and infinities cast to int32, in both
            expected, spread = numpy_channel_spread(image), _channel_spread(image)
        assert np.array_equal(spread, expected, equal_nan=image.dtype.kind == "f"), image.dtype
        sliced = np.dstack([image, image[:, :, :1]])[:, :, :3]  # a 4-channel image without its alpha, as decoded
        with np.errstate(invalid="ignore"):
            assert np.array_equal(_channel_spread(sliced), expected, equal_nan=image.dtype.kind == "f"), image.dtype


def test_channel_spread_equals_numpy_reduction_on_real_colour_films(shared_data):
    from covidxray.edge.preprocess import _channel_spread

    files = sorted((shared_data / "covid-chestxray-aug2020-768").rglob("*.*"))
    checked = 0
    for path in files:
        image = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
        if image is None or image.ndim != 3:
            continue
        image = image[:, :, :3]
        assert np.array_equal(_channel_spread(image), numpy_channel_spread(image)), path.name
        checked += 1
        if checked == 40:
            break
    assert checked == 40


# --- training and predict see the same pixels -------------------------------------------------


def test_predict_input_equals_the_training_shard_pixels(synthetic_data):
    from covidxray.data.tfrecord import read_records
    from covidxray.manifest import open_prepared

    size = open_prepared(synthetic_data).manifest.image_size
    with open(synthetic_data / "splits.csv", newline="") as handle:
        files = {(row["patient_id"], row["image"].rsplit("/", 1)[-1]): row["image"] for row in csv.DictReader(handle)}
    checked = 0
    for record in read_records(open_prepared(synthetic_data).shards("test")[:1]):
        _source, rest = record["record_id"].split(":", 1)  # "<source>:<file name>:<patient id>"
        name, patient = rest.split(":", 1)
        raw = files[(patient, name)]
        assert np.array_equal(model_input(raw, size), record["image"].astype(np.float32)), raw
        checked += 1
        if checked == 10:
            break
    assert checked == 10


# --- Ctrl-C inside a decoder is the user stopping the run, not a bad file -------------------------------------------


def interrupted_in_c(*_args, **_kwargs):
    """What CPython raises when a signal handler's KeyboardInterrupt lands inside a C function that then returns a
    result anyway (cv2.imread calling os.fspath): a SystemError whose cause is the interrupt (_PyErr_FormatFromCause)."""
    raise SystemError("<built-in function fspath> returned a result with an exception set") from KeyboardInterrupt()


def failing_in_c(*_args, **_kwargs):
    raise SystemError("a decoder bug, no interrupt")


def pixel_array_raising(raiser):
    return property(lambda _dataset: raiser())


INTERRUPT_POINTS = {  # where in decoding a Ctrl-C can land, each behind a different catch-all
    "raster decode": ("png", "cv2.imdecode", lambda raiser: raiser),
    "DICOM pixels": ("dcm", "pydicom.dataset.Dataset.pixel_array", pixel_array_raising),
    "DICOM modality LUT": ("dcm", "pydicom.pixels.apply_modality_lut", lambda raiser: raiser),
}  # not the DICOM header read (image_header): pure-Python pydicom, where an interrupt stays a KeyboardInterrupt


def decode_via(consumer: str, path) -> str | None:
    """Decode `path` as predict or prepare does; the error it reports for the file, or None."""
    if consumer == "predict":
        from covidxray.edge.predict import predict_path

        return predict_path(path, classifier=None).get("error")  # a file that fails to decode never reaches the model
    from covidxray.data.image_cache import decode_one

    return decode_one((str(path), 64, 10_000_000))[2].detail


@pytest.mark.parametrize("consumer", ["predict", "prepare"])
@pytest.mark.parametrize("point", INTERRUPT_POINTS)
def test_ctrl_c_inside_a_decoder_stops_the_run_and_a_decoder_error_does_not(tmp_path, monkeypatch, point, consumer):
    suffix, target, patch_with = INTERRUPT_POINTS[point]
    path = tmp_path / f"film.{suffix}"
    pixels = (np.arange(64 * 64).reshape(64, 64) % 251).astype(np.uint8)
    write_dicom(path, pixels) if suffix == "dcm" else cv2.imwrite(str(path), pixels)

    monkeypatch.setattr(target, patch_with(failing_in_c))
    assert decode_via(consumer, path), "a decoder's own failure is reported as that file's error"

    monkeypatch.setattr(target, patch_with(interrupted_in_c))
    with pytest.raises(KeyboardInterrupt):
        decode_via(consumer, path)
