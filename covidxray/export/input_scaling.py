"""Fold a model's input scaling into its first convolution, so an int8 build sees the pixels exactly.

Every model here takes gray pixels 0..255 and scales them inside (`Rescaling(scale, offset)`, e.g.
EfficientNet-Lite0's (x - 127) / 128). Converted to int8, that scaling is an op of its own whose output is
re-quantized on a calibrated grid that does not line up with the pixels' (Lite0: about 170 levels for the
256 pixel values), so each film loses input resolution before the first convolution, and that convolution
(the stem, with the largest weights after BatchNorm folding) spreads the loss into every later layer.

conv(W, s·x + o) = conv(s·W, x + o/s), padding included: zero padding on either side of the equation is
the same pixel value (o/s + x = 0 exactly where s·x + o = 0). The folded model is therefore the same
function (bit for bit when s is a power of two, as Lite0's 1/128 is), and when o/s is a whole number,
x + o/s is integer-exact in int8 (scale 1), so the first convolution gets the film unchanged. Measured
(docs/benchmarks.md §6): mean |Δp| between int8 and Keras drops by a third to almost a half on three
real models, and the three-class Lite0's int8 agreement rises from 96.19% to 97.76%.
"""

from __future__ import annotations

import tensorflow as tf

CONVOLUTIONS = (tf.keras.layers.Conv2D, tf.keras.layers.DepthwiseConv2D)  # linear in their input, as folding needs


def _only_consumer(layer: tf.keras.layers.Layer) -> tf.keras.layers.Layer | None:
    consumers = [node.outbound_layer for node in layer.outbound_nodes]
    return consumers[0] if len(consumers) == 1 else None


def _foldable_scaling(model: tf.keras.Model) -> tuple[tf.keras.layers.Rescaling, tf.keras.layers.Layer] | None:
    """The model's input Rescaling and the convolution it feeds, when folding one into the other is exact."""
    if len(model.inputs) != 1:
        return None
    first = _only_consumer(model.get_layer(index=0))
    if not isinstance(first, tf.keras.layers.Rescaling):
        return None
    scale, offset = first.scale, first.offset
    if not (isinstance(scale, (int, float)) and isinstance(offset, (int, float)) and scale > 0):
        return None  # a per-channel scaling: gray models never have one
    convolution = _only_consumer(first)
    if not isinstance(convolution, CONVOLUTIONS) or not float(offset / scale).is_integer():
        return None
    return first, convolution


def fold_input_scaling(model: tf.keras.Model) -> tf.keras.Model:
    """The same function with the input scaling moved into the first convolution's kernel; `model` itself when
    its input is not a scalar Rescaling feeding one convolution with a whole-number offset/scale."""
    found = _foldable_scaling(model)
    if found is None:
        return model
    scaling, convolution = found
    scale = float(scaling.scale)

    def clone_layer(layer: tf.keras.layers.Layer) -> tf.keras.layers.Layer:
        config = layer.get_config()
        if layer is scaling:
            config.update(scale=1.0, offset=float(scaling.offset) / scale)
        return layer.__class__.from_config(config)

    folded = tf.keras.models.clone_model(model, clone_function=clone_layer)
    folded.set_weights(model.get_weights())
    kernel, *bias = convolution.get_weights()  # the bias stays: it is added after the convolution
    folded.get_layer(convolution.name).set_weights([kernel * scale, *bias])
    return folded
