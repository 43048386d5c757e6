"""Grad-CAM heat maps (Selvaraju et al., 2017) from the Keras model: where did the model look?

The class score's gradient with respect to the last spatial feature map
weights that map's channels; their positive sum is the heat map. The score is
the logit before the softmax, so a confident prediction does not flatten the
gradient to nothing. Needs TensorFlow: only `predict --explain` imports this.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
import tensorflow as tf

from covidxray.edge.class_maps import normalised, overlay
from covidxray.edge.litert import TFLiteClassifier
from covidxray.errors import UserError
from covidxray.export.keras_file import load_keras_model
from covidxray.run_folder import MODEL_FILE


def _last_feature_layer(model: tf.keras.Model) -> tuple[tf.keras.layers.Layer, tf.keras.Model | None]:
    """The last layer with a 4-D output, and the nested backbone holding it (None if top level)."""
    for layer in reversed(model.layers):
        if isinstance(layer, tf.keras.Model) and len(layer.output.shape) != 4:
            inner, _ = _last_feature_layer(layer)
            return inner, layer
        if len(layer.output.shape) == 4:
            return layer, None
    raise UserError(f"model {model.name} has no spatial feature map: Grad-CAM needs a convolutional model")


def _score_head(model: tf.keras.Model) -> tuple[tf.Tensor, Callable[[tf.Tensor], tf.Tensor]]:
    """(tensor to stop at, function turning it into class scores): logits if the model ends in softmax Dense."""
    last = model.layers[-1]
    if isinstance(last, tf.keras.layers.Dense) and last.activation is tf.keras.activations.softmax:
        return last.input, lambda h: tf.matmul(h, last.kernel) + last.bias
    return model.output, lambda h: h


def score_function(model: tf.keras.Model) -> Callable[[tf.Tensor], tuple[tf.Tensor, tf.Tensor]]:
    """images -> (last feature maps, class scores), both from one differentiable pass."""
    target, backbone = _last_feature_layer(model)
    stop, to_scores = _score_head(model)
    if backbone is None:
        split = tf.keras.Model(model.inputs, [target.output, stop])
        return lambda images: (lambda maps, h: (maps, to_scores(h)))(*split(images, training=False))
    # A nested backbone (Keras applications): run the outer graph in three pieces around it.
    call = backbone.inbound_nodes[-1]
    before = tf.keras.Model(model.inputs, call.input_tensors)
    inside = tf.keras.Model(backbone.inputs, [target.output, backbone.output])
    after = tf.keras.Model(call.output_tensors, stop)

    def forward(images):
        maps, features = inside(before(images, training=False), training=False)
        return maps, to_scores(after(features, training=False))

    return forward


def heatmaps(forward: Callable, images: np.ndarray, class_indices: list[int]) -> np.ndarray:
    """(n, size, size, 1) model inputs -> n heat maps in [0, 1] at the feature map's resolution, each of its class.

    One pass for the batch: in inference mode an image's score depends on its own feature maps only, so the
    gradient of the summed scores is, image by image, the gradient of that image's score.
    """
    batch = tf.convert_to_tensor(images, tf.float32)
    with tf.GradientTape() as tape:
        maps, scores = forward(batch)
        score = tf.reduce_sum(scores * tf.one_hot(class_indices, scores.shape[-1]))
    grads = tape.gradient(score, maps)
    weights = tf.reduce_mean(grads, axis=(1, 2), keepdims=True)
    return np.stack([normalised(cam) for cam in tf.reduce_sum(weights * maps, axis=-1).numpy()])


def heatmap(forward: Callable, image: np.ndarray, class_index: int) -> np.ndarray:
    """(size, size, 1) model input -> heat map in [0, 1] at the feature map's resolution."""
    return heatmaps(forward, image[None], [class_index])[0]


def gradcam_for(out_dir: Path, keras_model: Path | None = None) -> Callable[[TFLiteClassifier], GradCamWriter]:
    """Predict's explainer: Grad-CAM on the Keras model the .tflite was converted from.

    That model is `model.keras` in the folder of the .tflite (the run folder export wrote both into), or the
    file `--keras-model` names; either way it must be the very file whose sha256 export recorded in the
    sidecar (which is itself bound to the .tflite), and it is loaded in Keras' safe mode
    (covidxray/export/keras_file.py). The sidecar's own `keras_model` entry is never used as a path.
    """

    def make(classifier: TFLiteClassifier) -> GradCamWriter:
        expected = classifier.card.keras_sha256
        if not isinstance(expected, str):
            raise UserError(
                f"the sidecar of {classifier.path} records no sha256 of the Keras model it was converted from (exported by an older covidxray): export again to use --explain"
            )
        model_path = keras_model or classifier.path.parent / MODEL_FILE
        if not model_path.is_file():
            raise UserError(
                f"--explain needs the Keras model {classifier.path.name} was converted from: {model_path} not found (run predict --explain on the export's run folder, or give --keras-model)"
            )
        model = load_keras_model(
            model_path,
            expected,
            f"the model {classifier.path.name} was converted from (retrained or replaced since that export?): "
            "export again, or give --keras-model the model.keras of that export",
        )
        return GradCamWriter(model, out_dir)

    return make


class GradCamWriter:
    """Writes `<stem>.gradcam.png` per explained image into `out_dir`."""

    def __init__(self, model: tf.keras.Model, out_dir: Path):
        self.forward = score_function(model)
        self.out_dir = out_dir
        self.used: set[str] = set()
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(f"cannot make --explain-dir {out_dir} ({err.strerror or err})") from None

    def _name(self, source: Path) -> Path:
        """`<stem>.gradcam.png`, numbered when two inputs share a stem (same name, other folder)."""
        name, n = f"{source.stem}.gradcam.png", 1
        while name in self.used:
            n += 1
            name = f"{source.stem}-{n}.gradcam.png"
        self.used.add(name)
        return self.out_dir / name

    def __call__(self, source: Path, gray: np.ndarray, image: np.ndarray, class_index: int) -> Path:
        out = self._name(source)
        if not cv2.imwrite(str(out), overlay(gray, heatmap(self.forward, image, class_index))):
            raise UserError(f"cannot write {out}: check --explain-dir is writable")
        return out
