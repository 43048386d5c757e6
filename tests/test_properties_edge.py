"""Property-based tests (Hypothesis) of the edge parsers that take outside input: no input may end in a
traceback or a hang, only in the documented answer (issue 25, item 10).

- the image-header reader (covidxray/edge/image_header.py): a size or None, never an exception;
- the decode path for DICOM and rasters (covidxray/edge/preprocess.py `load_gray`): an image or ImageError;
- the sidecar loader (covidxray/edge/litert.py `TFLiteClassifier`): a usable model or UserError.

Inputs are random bytes and real files with random damage (bytes changed, cut short, inserted), which reach
far deeper into each parser than noise alone. Examples are derandomised (the same every run, so CI is stable)
and bounded by `max_examples` and a per-example deadline, which is also the hang check.
"""

from __future__ import annotations

import json
import struct
from datetime import timedelta
from pathlib import Path

import cv2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_preprocess import write_dicom

from covidxray.edge.image_header import declared_size
from covidxray.edge.preprocess import ImageError, load_gray
from covidxray.errors import UserError

PROPERTY = settings(
    max_examples=150,
    deadline=timedelta(seconds=2),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
SIDECAR_PROPERTY = settings(PROPERTY, max_examples=50)  # each example loads a model: ~0.1 s


def damaged(original: bytes):
    """A strategy: `original` with some bytes changed, a cut, and an insertion, each optional."""
    edits = st.lists(st.tuples(st.integers(0, len(original) - 1), st.integers(0, 255)), max_size=8)
    return st.builds(
        _apply,
        st.just(original),
        edits,
        st.one_of(st.none(), st.integers(0, len(original))),
        st.one_of(st.none(), st.tuples(st.integers(0, len(original)), st.binary(max_size=64))),
    )


def _apply(original: bytes, edits, cut, insertion) -> bytes:
    data = bytearray(original)
    for at, value in edits:
        data[at] = value
    if insertion is not None:
        data[insertion[0] : insertion[0]] = insertion[1]
    return bytes(data[:cut] if cut is not None else data)


def _image_bytes() -> dict[str, bytes]:
    gray = np.random.default_rng(0).integers(0, 256, (40, 48), dtype=np.uint8)
    files = {suffix: cv2.imencode(suffix, gray)[1].tobytes() for suffix in (".png", ".jpg", ".bmp", ".tif")}
    files[".jpg"] = files[".jpg"][:2] + b"\xff\xe1" + struct.pack(">H", 18) + bytes(16) + files[".jpg"][2:]
    return files


IMAGES = _image_bytes()
MAGIC = [b"", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", b"\xff\xd8", b"BM", b"II*\x00", b"MM\x00*"]


@PROPERTY
@given(st.sampled_from(MAGIC), st.binary(max_size=300))
def test_header_reader_on_random_bytes_gives_a_size_or_none(tmp_path, magic, tail):
    path = tmp_path / "x.img"
    path.write_bytes(magic + tail)
    _assert_size_or_none(declared_size(path))


@PROPERTY
@given(st.sampled_from(sorted(IMAGES)).flatmap(lambda suffix: damaged(IMAGES[suffix])))
def test_header_reader_on_damaged_real_files_gives_a_size_or_none(tmp_path, data):
    path = tmp_path / "x.img"
    path.write_bytes(data)
    _assert_size_or_none(declared_size(path))


def test_header_reader_reads_the_undamaged_files():
    """The oracle for the two tests above: each real file's own size."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        for suffix, data in IMAGES.items():
            path = Path(folder) / f"x{suffix}"
            path.write_bytes(data)
            assert declared_size(path) == (48, 40), suffix


def _assert_size_or_none(size) -> None:
    assert size is None or (
        isinstance(size, tuple) and len(size) == 2 and all(isinstance(v, int) and v >= 0 for v in size)
    ), size


@PROPERTY
@given(st.sampled_from(sorted(IMAGES)).flatmap(lambda suffix: damaged(IMAGES[suffix])))
def test_decoding_a_damaged_raster_gives_an_image_or_an_image_error(tmp_path, data):
    path = tmp_path / "x.png"
    path.write_bytes(data)
    _assert_image_or_image_error(path)


def _dicom_bytes(tmp_path_factory) -> bytes:
    folder = tmp_path_factory.mktemp("dicom")
    pixels = (np.random.default_rng(1).integers(0, 4096, (24, 20))).astype(np.uint16)
    path = write_dicom(folder / "cr.dcm", pixels, modality="CR", BitsStored=12, WindowCenter=2048, WindowWidth=4096)
    return path.read_bytes()


@pytest.fixture(scope="module")
def dicom_file(tmp_path_factory) -> bytes:
    return _dicom_bytes(tmp_path_factory)


def test_the_undamaged_dicom_decodes(dicom_file, tmp_path):
    path = tmp_path / "cr.dcm"
    path.write_bytes(dicom_file)
    assert load_gray(path).shape == (24, 20)


@PROPERTY
@given(data=st.data())
def test_decoding_a_damaged_dicom_gives_an_image_or_an_image_error(dicom_file, tmp_path, data):
    damaged_file = data.draw(damaged(dicom_file))
    for name in ("x.dcm", "IM0001"):  # by suffix, and suffix-less (sniffed by its preamble)
        path = tmp_path / name
        path.write_bytes(damaged_file)
        _assert_image_or_image_error(path)


@PROPERTY
@given(st.binary(max_size=400))
def test_decoding_random_bytes_as_dicom_gives_an_image_or_an_image_error(tmp_path, data):
    path = tmp_path / "x.dcm"
    path.write_bytes(bytes(128) + b"DICM" + data)
    _assert_image_or_image_error(path)


def _assert_image_or_image_error(path: Path) -> None:
    try:
        gray = load_gray(path)
    except ImageError as err:
        assert err.reason in {"missing", "empty", "unreadable", "not-xray", "unsupported", "too-large"}
        return
    assert isinstance(gray, np.ndarray) and gray.dtype == np.uint8 and gray.ndim == 2 and min(gray.shape) >= 16


# --- the sidecar loader ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory) -> tuple[bytes, dict]:
    """A real two-output .tflite (small_cnn at 16 px, as export converts it) and a complete, valid sidecar."""
    pytest.importorskip("tensorflow")
    from covidxray.edge import orientation
    from covidxray.edge.chest_layout import SIDE, LayoutModel
    from covidxray.edge.ood import OodModel
    from covidxray.edge.orientation import OrientationModel
    from covidxray.edge.preprocess import PREPROCESSING_VERSION
    from covidxray.export.class_maps import served_model
    from covidxray.export.tflite import convert, write_saved_model
    from covidxray.train.models import build_model

    folder = tmp_path_factory.mktemp("tiny")
    model = served_model(build_model("small_cnn", 16, 3))
    flatbuffer = convert(write_saved_model(model, folder), "float32")
    dim = int(model.outputs[1].shape[-1])
    card = {
        "labels": ["normal", "pneumonia", "covid-19"],
        "image_size": 16,
        "preprocessing": PREPROCESSING_VERSION,
        "temperature": {"value": 1.3},
        "ood": OodModel(np.zeros((3, dim)), np.eye(dim), 5.0).to_sidecar({}),
        "layout": LayoutModel(np.zeros(SIDE * SIDE), np.eye(SIDE * SIDE), 9.0).to_sidecar({}),
        "orientation": OrientationModel(
            np.zeros((1, 2, orientation.SIDE**2)), np.zeros((1, 2)), np.zeros((1, 4, 2)), np.array([[1.0, 0, 0, 0]])
        ).to_sidecar({}),
    }
    return flatbuffer, card


@pytest.fixture
def no_retry_wait(monkeypatch):
    """A mismatched pair is read again after PAIR_RETRY_S (litert.py): not worth waiting for in every example."""
    from covidxray.edge import litert

    monkeypatch.setattr(litert, "PAIR_RETRY_S", 0.0)


def _load(folder: Path, flatbuffer: bytes, card_bytes: bytes):
    from covidxray.edge.litert import TFLiteClassifier

    (folder / "model-float32.tflite").write_bytes(flatbuffer)
    (folder / "model-float32.json").write_bytes(card_bytes)
    try:
        return TFLiteClassifier(folder / "model-float32.tflite")
    except UserError as err:
        assert str(err) and "Traceback" not in str(err)
        return None


def test_the_valid_tiny_sidecar_loads(tiny_export, tmp_path):
    from covidxray.edge.model_binding import bind

    flatbuffer, card = bind(*tiny_export)
    classifier = _load(tmp_path, flatbuffer, json.dumps(card).encode())
    assert classifier is not None and classifier.temperature == 1.3 and classifier.layout.threshold == 9.0


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
SIDECAR_PATHS = [
    ("labels",),
    ("image_size",),
    ("temperature",),
    ("temperature", "value"),
    ("ood",),
    ("ood", "threshold"),
    ("ood", "dim"),
    ("ood", "classes"),
    ("ood", "means"),
    ("ood", "precision"),
    ("layout",),
    ("layout", "threshold"),
    ("layout", "version"),
    ("layout", "side"),
    ("layout", "mean"),
    ("orientation",),
    ("orientation", "hidden_weights"),
    ("orientation", "members"),
    ("orientation", "version"),
    ("tflite_sha256",),
]


def _replace(card, path: tuple[str, ...], value):
    if not isinstance(card, dict):
        return card
    if len(path) == 1:
        return {**card, path[0]: value}
    return {**card, path[0]: _replace(card.get(path[0]), path[1:], value)}


@SIDECAR_PROPERTY
@given(st.lists(st.tuples(st.sampled_from(SIDECAR_PATHS), JSON_VALUES), min_size=1, max_size=3), st.booleans())
def test_a_sidecar_with_any_values_loads_or_is_one_user_error(tiny_export, tmp_path, no_retry_wait, edits, rebind):
    """Any entry replaced by any JSON value; re-bound to the model or not (then the digest refuses it)."""
    from covidxray.edge.model_binding import bind

    flatbuffer, card = bind(*tiny_export)
    for path, value in edits:
        card = _replace(card, path, value)
    if rebind:
        flatbuffer, card = bind(tiny_export[0], card)
    classifier = _load(tmp_path, flatbuffer, json.dumps(card).encode())
    if classifier is not None:  # then every value it uses is sound
        assert np.isfinite(classifier.temperature) and classifier.temperature > 0
        assert np.isfinite(classifier.ood.threshold) and np.isfinite(classifier.layout.threshold)


@SIDECAR_PROPERTY
@given(data=st.data(), damage_sidecar=st.booleans())
def test_any_change_to_the_sidecar_or_the_model_is_one_user_error(
    tiny_export, tmp_path, no_retry_wait, data, damage_sidecar
):
    """Bytes changed, cut or inserted in either file: refused unless the sidecar still says exactly the same."""
    from covidxray.edge.model_binding import bind

    flatbuffer, card = bind(*tiny_export)
    text = json.dumps(card).encode()
    if damage_sidecar:
        text = data.draw(damaged(text))
        try:
            unchanged = json.loads(text) == card
        except ValueError:
            unchanged = False
    else:
        changed = data.draw(damaged(flatbuffer))
        unchanged, flatbuffer = changed == flatbuffer, changed
    assert (_load(tmp_path, flatbuffer, text) is not None) == unchanged
