"""EfficientNet-Lite0 in Keras, and the mapping of its official ImageNet weights onto it.

EfficientNet-Lite (Tan & Le; tensorflow/tpu models/official/efficientnet/lite) is
EfficientNet-B0 made for integer edge inference: ReLU6 instead of swish, no
squeeze-excite, and a stem and head that do not scale. Those are the parts that
post-training int8 quantization handles badly in MobileNetV3 (hard-swish,
squeeze-excite), which is why this is the edge backbone.

Layer names follow the PyTorch state dict's module paths (`_blocks.3._expand_conv`
-> `blocks_3_expand_conv`), so `load_imagenet` maps every tensor by name and a
missing or extra tensor is an error, never a silently random layer.

The weights were converted from the TensorFlow checkpoints, whose "same"
padding PyTorch emulates with static padding; Keras' padding="same" is the
original. Input: pixel values 0..255 normalised as (x - 127) / 128 (the Lite
checkpoints' MEAN_RGB/STDDEV_RGB).
"""

from __future__ import annotations

import re

import numpy as np
import tensorflow as tf

from covidxray.errors import UserError

# Per stage: (repeats, kernel, first stride, expansion, output channels); EfficientNet-B0's, width and depth 1.0.
STAGES = (
    (1, 3, 1, 1, 16),
    (2, 3, 2, 6, 24),
    (2, 5, 2, 6, 40),
    (3, 3, 2, 6, 80),
    (3, 5, 1, 6, 112),
    (4, 5, 2, 6, 192),
    (1, 3, 1, 6, 320),
)
STEM_CHANNELS, HEAD_CHANNELS = 32, 1280
BN_EPSILON = 1e-3  # the checkpoints' batch_norm_epsilon; Keras' default too, written out because the mapping needs it
BN_MOMENTUM = 0.99
INPUT_MEAN, INPUT_STD = 127.0, 128.0
IMAGENET_CLASSES = 1000


def keras_name(torch_module: str) -> str:
    """`_blocks.3._expand_conv` -> `blocks_3_expand_conv`: the Keras layer that holds that PyTorch module's tensors."""
    return re.sub(r"(^|\.)_?", lambda m: "_" if m.group(1) else "", torch_module)


def _conv_bn(x, filters: int, kernel: int, stride: int, conv: str, bn: str, activation: bool, depthwise: bool = False):
    layers = tf.keras.layers
    if depthwise:
        x = layers.DepthwiseConv2D(kernel, stride, padding="same", use_bias=False, name=keras_name(conv))(x)
    else:
        x = layers.Conv2D(filters, kernel, stride, padding="same", use_bias=False, name=keras_name(conv))(x)
    x = layers.BatchNormalization(epsilon=BN_EPSILON, momentum=BN_MOMENTUM, name=keras_name(bn))(x)
    return layers.ReLU(6.0, name=keras_name(bn) + "_relu6")(x) if activation else x


def features(pixels: tf.Tensor) -> tf.Tensor:
    """Pixel values 0..255 (any number of channels) -> the 1280 pooled Lite0 features."""
    layers = tf.keras.layers
    x = layers.Rescaling(1.0 / INPUT_STD, offset=-INPUT_MEAN / INPUT_STD, name="normalise")(pixels)
    x = _conv_bn(x, STEM_CHANNELS, 3, 2, "_conv_stem", "_bn0", activation=True)
    channels, block = STEM_CHANNELS, 0
    for repeats, kernel, first_stride, expansion, out_channels in STAGES:
        for repeat in range(repeats):
            stride, inputs, prefix = (first_stride if repeat == 0 else 1), x, f"_blocks.{block}."
            if expansion != 1:
                x = _conv_bn(x, channels * expansion, 1, 1, prefix + "_expand_conv", prefix + "_bn0", activation=True)
            x = _conv_bn(x, 0, kernel, stride, prefix + "_depthwise_conv", prefix + "_bn1", True, depthwise=True)
            x = _conv_bn(x, out_channels, 1, 1, prefix + "_project_conv", prefix + "_bn2", activation=False)
            if stride == 1 and channels == out_channels:
                x = layers.Add(name=keras_name(prefix + "_add"))([inputs, x])
            channels, block = out_channels, block + 1
    x = _conv_bn(x, HEAD_CHANNELS, 1, 1, "_conv_head", "_bn1", activation=True)
    return layers.GlobalAveragePooling2D(name="pool")(x)


def imagenet_classifier(image_size: int = 224, channels: int = 3) -> tf.keras.Model:
    """Lite0 with its 1000-class ImageNet head (`_fc`): for checking the weight mapping on real photos."""
    inputs = tf.keras.layers.Input((image_size, image_size, channels), name="image")
    outputs = tf.keras.layers.Dense(IMAGENET_CLASSES, activation="softmax", name=keras_name("_fc"))(features(inputs))
    return tf.keras.Model(inputs, outputs, name="efficientnet_lite0_imagenet")


def _keras_arrays(layer: tf.keras.layers.Layer, tensors: dict[str, np.ndarray]) -> list[np.ndarray]:
    """PyTorch tensors of one module -> that Keras layer's weights, in the order `layer.set_weights` takes."""
    if isinstance(layer, tf.keras.layers.BatchNormalization):
        return [tensors["weight"], tensors["bias"], tensors["running_mean"], tensors["running_var"]]
    if isinstance(layer, tf.keras.layers.DepthwiseConv2D):  # (C, 1, kh, kw) -> (kh, kw, C, 1)
        return [tensors["weight"].transpose(2, 3, 0, 1)]
    if isinstance(layer, tf.keras.layers.Conv2D):  # (O, I, kh, kw) -> (kh, kw, I, O)
        kernel = tensors["weight"].transpose(2, 3, 1, 0)
        if kernel.shape[2] == 3 and layer.kernel.shape[2] == 1:
            # The stem sees gray: conv(x, x, x) over RGB kernels equals conv(x) over their sum.
            kernel = kernel.sum(axis=2, keepdims=True)
        return [kernel]
    if isinstance(layer, tf.keras.layers.Dense):  # (out, in) -> (in, out)
        return [tensors["weight"].T, tensors["bias"]]
    raise TypeError(f"no weight mapping for {type(layer).__name__}")


def load_imagenet(model: tf.keras.Model, state_dict: dict[str, np.ndarray], with_classifier: bool = False) -> None:
    """Set every Lite0 layer of `model` from the PyTorch state dict; every backbone tensor must find its layer."""
    modules: dict[str, dict[str, np.ndarray]] = {}
    for key, value in state_dict.items():
        module, _, parameter = key.rpartition(".")
        if parameter != "num_batches_tracked" and (with_classifier or module != "_fc"):
            modules.setdefault(module, {})[parameter] = value
    for module, tensors in modules.items():
        try:
            layer = model.get_layer(keras_name(module))
        except ValueError:
            raise UserError(
                f"the weights hold {module}, which the Lite0 model lacks: not EfficientNet-Lite0 weights"
            ) from None
        arrays = _keras_arrays(layer, tensors)
        expected = [tuple(w.shape) for w in layer.get_weights()]
        if [a.shape for a in arrays] != expected:
            raise UserError(f"weights for {module} have shapes {[a.shape for a in arrays]}, the model wants {expected}")
        layer.set_weights(arrays)
    mapped = {keras_name(m) for m in modules}
    unset = [layer.name for layer in model.layers if layer.weights and layer.name not in mapped]
    if unset and unset != ["probabilities"]:
        raise UserError(f"the weights leave Lite0 layers {unset} without values: not EfficientNet-Lite0 weights")
