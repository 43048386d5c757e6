"""Grad-CAM without TensorFlow: the exported model's class maps against the Keras Grad-CAM (the oracle).

covidxray/edge/class_maps.py derives that for a global-average-pooling head the class activation map equals
Grad-CAM up to a positive scale; here that is checked, not assumed: the maps export adds (covidxray/export/
class_maps.py), run through the TFLite converter and the LiteRT interpreter predict uses, against
covidxray/export/gradcam.py's gradient-tape Grad-CAM on the same Keras model, for every class.
"""

from __future__ import annotations

import numpy as np
import pytest

SIZE, CLASSES = 32, 3


def tiny_model(nested: bool):
    """Conv -> global average pooling -> dropout -> softmax Dense, the pooling at top level or inside a nested
    backbone (as the Keras applications have it)."""
    tf = pytest.importorskip("tensorflow")
    layers = tf.keras.layers
    tf.keras.utils.set_random_seed(3)
    inputs = layers.Input((SIZE, SIZE, 1), name="image")

    def body(x):
        x = layers.Rescaling(1 / 255)(x)
        x = layers.Conv2D(8, 3, activation="relu")(x)
        x = layers.Conv2D(12, 3, strides=2, activation="relu")(x)
        return layers.GlobalAveragePooling2D()(x)

    if nested:
        backbone_in = layers.Input((SIZE, SIZE, 1))
        features = tf.keras.Model(backbone_in, body(backbone_in), name="backbone")(inputs)
    else:
        features = body(inputs)
    x = layers.Dropout(0.3)(features)
    outputs = layers.Dense(CLASSES, activation="softmax", name="probabilities")(x)
    return tf.keras.Model(inputs, outputs)


def images(count: int = 3) -> np.ndarray:
    rng = np.random.default_rng(5)
    return rng.uniform(0, 255, (count, SIZE, SIZE, 1)).astype(np.float32)


@pytest.mark.slow  # two SavedModel conversions, ~25 s each on 2 cores
@pytest.mark.parametrize("nested", [False, True], ids=["top-level-pooling", "nested-backbone"])
def test_litert_class_maps_equal_keras_gradcam(nested, tmp_path):
    from covidxray.edge.class_maps import heat_map
    from covidxray.edge.litert import TFLiteClassifier
    from covidxray.export.class_maps import served_model
    from covidxray.export.gradcam import heatmap, score_function
    from covidxray.export.tflite import convert, write_saved_model

    model = tiny_model(nested)
    served = served_model(model)
    assert served.output_names == ["probabilities", "embedding", "class_maps"]
    flatbuffer = convert(write_saved_model(served, tmp_path), "float32")
    card = {"labels": ["a", "b", "c"], "image_size": SIZE}
    classifier = TFLiteClassifier(tmp_path / "model-float32.tflite", flatbuffer=flatbuffer, card=card)
    forward = score_function(model)
    for image in images():
        probabilities, _ = classifier.infer(image)
        np.testing.assert_allclose(probabilities, model(image[None]).numpy()[0], atol=1e-5)
        maps = classifier.class_maps()
        for class_index in range(CLASSES):
            oracle = heatmap(forward, image, class_index)
            assert oracle.max() > 0  # a map with content, so the comparison means something
            np.testing.assert_allclose(heat_map(maps, class_index), oracle, atol=1e-4)


def test_a_head_that_is_not_pooling_gets_no_class_maps():
    pytest.importorskip("tensorflow")
    from covidxray.export.class_maps import served_model
    from covidxray.train.models import build_model

    served = served_model(build_model("small_cnn", SIZE, CLASSES))  # Flatten -> Dense(ReLU): Grad-CAM is not CAM
    assert served.output_names == ["probabilities", "embedding"]
