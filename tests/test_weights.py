"""ImageNet weights: Keras' own file names, hashes and cache, against a 127.0.0.1 stand-in for the weights host."""

from __future__ import annotations

import hashlib
import socket

import numpy as np
import pytest
import tensorflow as tf
from layouts import FileServer

from covidxray.errors import UserError
from covidxray.train import weights
from covidxray.train.models import build_model

SIZE = 32  # the backbone weights do not depend on the input size; 32 px keeps the test fast


def quiet(_message: str) -> None:
    pass


@pytest.fixture(scope="module")
def backbone_file(tmp_path_factory) -> bytes:
    """A real MobileNetV3Small no-top .h5 (random weights, saved as Keras saves its ImageNet files)."""
    path = tmp_path_factory.mktemp("backbone") / "backbone.h5"
    tf.keras.utils.set_random_seed(1)
    tf.keras.applications.MobileNetV3Small(
        include_top=False, weights=None, input_shape=(SIZE, SIZE, 3), pooling="avg"
    ).save_weights(str(path))
    return path.read_bytes()


@pytest.fixture
def served(monkeypatch, backbone_file):
    """The weights host on 127.0.0.1, with Keras' file name and a hash that matches the served bytes."""
    real = weights.keras_weights("mobilenet_v3_small")
    with FileServer({"/" + real.file_name: backbone_file}) as server:
        monkeypatch.setenv(weights.MIRROR_VARIABLE, server.url(""))
        fake = weights.KerasWeights(real.file_name, real.base_url, hashlib.md5(backbone_file).hexdigest())
        monkeypatch.setitem(weights.IMAGENET_WEIGHTS, "mobilenet_v3_small", lambda: fake)
        yield server, real.file_name


def test_weights_are_keras_own_file_url_and_hash():
    from keras.src.applications import efficientnet, mobilenet_v3

    spec = weights.keras_weights("mobilenet_v3_small")
    assert (
        spec.url
        == "https://storage.googleapis.com/tensorflow/keras-applications/mobilenet_v3/weights_mobilenet_v3_small_224_1.0_float_no_top_v2.h5"
    )
    assert spec.md5 == mobilenet_v3.WEIGHTS_HASHES["small_224_1.0_float"][1]
    spec = weights.keras_weights("efficientnet_b0")
    assert spec.url == "https://storage.googleapis.com/keras-applications/efficientnetb0_notop.h5"
    assert spec.md5 == efficientnet.WEIGHTS_HASHES["b0"][1]
    with pytest.raises(UserError, match="small_cnn"):
        weights.keras_weights("small_cnn")


def test_download_writes_the_checked_file_and_resumes_a_partial_one(served, backbone_file, tmp_path):
    server, name = served
    out = tmp_path / "w.h5"
    assert weights.download_weights("mobilenet_v3_small", out, say=quiet) == out
    assert out.read_bytes() == backbone_file

    resumed = tmp_path / "resumed.h5"
    half = len(backbone_file) // 2
    (tmp_path / "resumed.h5.partial").write_bytes(backbone_file[:half])
    server.requests.clear()
    weights.download_weights("mobilenet_v3_small", resumed, say=quiet)
    assert resumed.read_bytes() == backbone_file
    assert server.requests == [("/" + name, f"bytes={half}-")]


def test_download_refuses_a_file_with_the_wrong_hash(served, backbone_file, tmp_path):
    server, name = served
    server.files["/" + name] = backbone_file[:-1] + bytes([backbone_file[-1] ^ 1])
    out = tmp_path / "w.h5"
    with pytest.raises(UserError, match="md5 .* is not the"):
        weights.download_weights("mobilenet_v3_small", out, say=quiet, retries=0)
    assert not out.exists() and not (tmp_path / "w.h5.partial").exists()


def test_download_with_the_server_down_says_what_to_do(monkeypatch, tmp_path):
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv(weights.MIRROR_VARIABLE, f"http://127.0.0.1:{port}")
    with pytest.raises(UserError, match="re-run to resume"):
        weights.download_weights("mobilenet_v3_small", tmp_path / "w.h5", say=quiet, retries=0)
    with pytest.raises(UserError, match="covidxray weights download mobilenet_v3_small"):
        monkeypatch.setenv("HOME", str(tmp_path))
        weights.cached_imagenet_file("mobilenet_v3_small")


@pytest.mark.slow
def test_imagenet_goes_through_the_keras_cache_and_loads_into_the_backbone(
    served, backbone_file, monkeypatch, tmp_path
):
    server, name = served
    monkeypatch.setenv("HOME", str(tmp_path))
    model = build_model("mobilenet_v3_small", SIZE, 2, weights.IMAGENET)
    cached = tmp_path / ".keras" / "models" / name
    assert cached.read_bytes() == backbone_file
    reference = tf.keras.applications.MobileNetV3Small(
        include_top=False, weights=str(cached), input_shape=(SIZE, SIZE, 3), pooling="avg"
    )
    backbone = next(layer for layer in model.layers if isinstance(layer, tf.keras.Model))
    for got, expected in zip(backbone.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(got, expected)

    requests = len(server.requests)
    build_model("mobilenet_v3_small", SIZE, 2, weights.IMAGENET)  # second build: from the cache
    assert len(server.requests) == requests

    cached.write_bytes(b"damaged")  # a damaged cache file fails Keras' hash and is fetched again
    build_model("mobilenet_v3_small", SIZE, 2, weights.IMAGENET)
    assert cached.read_bytes() == backbone_file and len(server.requests) == requests + 1


def test_small_cnn_refuses_imagenet():
    with pytest.raises(UserError, match="no ImageNet weights"):
        build_model("small_cnn", SIZE, 2, weights.IMAGENET)


@pytest.mark.slow
@pytest.mark.parametrize("name,expected_range", [("mobilenet_v3_small", (-1.0, 1.0)), ("efficientnet_b0", (0.0, 1.0))])
def test_gray_pixels_reach_the_backbone_in_its_documented_range(name, expected_range):
    """Keras 2.15 docs: both backbones take 0..255 RGB and rescale inside (MobileNetV3 to -1..1, EfficientNet to 0..1)."""
    gray = np.zeros((1, SIZE, SIZE, 1), np.float32)
    gray[0, : SIZE // 2] = 255.0  # half black, half white: the extremes of the input range
    model = build_model(name, SIZE, 2)
    backbone = next(layer for layer in model.layers if isinstance(layer, tf.keras.Model))
    rescaling = next(layer for layer in backbone.layers if isinstance(layer, tf.keras.layers.Rescaling))
    fed = tf.keras.Model(model.input, model.layers[1].output)(gray).numpy()  # what the backbone receives
    assert fed.shape[-1] == 3 and (fed == gray).all()
    scaled = rescaling(fed).numpy()
    assert (scaled.min(), scaled.max()) == pytest.approx(expected_range)


def test_cli_weights_download_refuses_bytes_keras_does_not_know(tmp_path):
    """Through the command a user types: the served file is not Keras' file, so its md5 fails and nothing is kept."""
    from conftest import run_cli

    name = weights.keras_weights("efficientnet_b0").file_name
    with FileServer({"/" + name: b"not the weights" * 1000}) as server:
        result = run_cli(
            "weights",
            "download",
            "efficientnet_b0",
            "--out",
            str(tmp_path),
            env={weights.MIRROR_VARIABLE: server.url("")},
        )
    assert result.returncode == 2 and "is not the" in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []
