"""The graph export serves: the model's probabilities, its embedding and, where they equal Grad-CAM, its class maps.

Outputs by name: `probabilities`; `embedding` (what feeds the last layer: the
penultimate features, for the out-of-distribution score); and `class_maps`
when the last layer reads global-average-pooled features through dropout only
(every registered model but small_cnn). The maps are that Dense layer's kernel
applied at every position of the pooled feature map, as a 1x1 convolution
without bias: Grad-CAM up to a positive scale (covidxray/edge/class_maps.py has
the derivation), so predict and serve draw the overlay without TensorFlow.
"""

from __future__ import annotations

import tensorflow as tf

from covidxray.edge.litert import CLASS_MAPS_OUTPUT, EMBEDDING_OUTPUT


def _source(layer: tf.keras.layers.Layer) -> tf.keras.layers.Layer | None:
    """The one layer whose output `layer` reads (in the model it was built in), or None when it reads several."""
    inbound = layer.inbound_nodes[0].inbound_layers
    return None if isinstance(inbound, list) else inbound


def _pooling_below(head: tf.keras.layers.Layer) -> tuple[list[tf.keras.layers.Layer], tf.keras.layers.Layer | None]:
    """(the dropout layers between `head` and what feeds them, that feeding layer), walking down from `head`."""
    dropouts: list[tf.keras.layers.Layer] = []
    below = _source(head)
    while isinstance(below, tf.keras.layers.Dropout):
        dropouts.insert(0, below)
        below = _source(below)
    return dropouts, below


def _is_pooling(layer: object) -> bool:
    return isinstance(layer, tf.keras.layers.GlobalAveragePooling2D) and not layer.keepdims


def served_model(model: tf.keras.Model) -> tf.keras.Model:
    """`model` with the outputs export converts: probabilities, embedding and (when they are Grad-CAM) class maps."""
    names = [layer.name for layer in model.layers]
    head = model.get_layer("probabilities") if "probabilities" in names else model.layers[-1]
    dropouts, below = _pooling_below(head)
    is_softmax_dense = isinstance(head, tf.keras.layers.Dense) and head.activation is tf.keras.activations.softmax
    if is_softmax_dense and below is not None and _is_pooling(below):
        maps, probabilities, features = below.input, model.output, head.input
    elif (
        is_softmax_dense
        and isinstance(below, tf.keras.Model)
        and _is_pooling(below.layers[-1])
        and below.layers[-1].output is below.output
    ):
        # A nested Keras application: its inner feature map is no tensor of this graph. Call the backbone again,
        # with the map as a second output, and the head on its pooled output, so the graph runs it once.
        inner = tf.keras.Model(below.inputs, [below.layers[-1].input, below.output])
        maps, features = inner(below.inbound_nodes[-1].input_tensors)
        for dropout in dropouts:
            features = dropout(features)
        probabilities = head(features)
    else:  # e.g. small_cnn's Flatten -> Dense(ReLU) head: Grad-CAM depends on the input there; no maps
        embedding = tf.keras.layers.Activation("linear", name=EMBEDDING_OUTPUT)(head.input)
        return tf.keras.Model(model.inputs, [model.output, embedding], name=model.name)
    embedding = tf.keras.layers.Activation("linear", name=EMBEDDING_OUTPUT)(features)
    to_maps = tf.keras.layers.Conv2D(head.units, 1, use_bias=False, name=CLASS_MAPS_OUTPUT)
    class_maps = to_maps(maps)
    to_maps.set_weights([head.kernel.numpy()[None, None]])
    return tf.keras.Model(model.inputs, [probabilities, embedding, class_maps], name=model.name)
