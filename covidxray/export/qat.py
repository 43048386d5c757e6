"""Quantization-aware fine-tuning for the int8 build (export.int8_method: qat), distilled from the model exported.

Post-training int8 (ptq) rounds a float model once: on near-ties (two classes a few hundredths apart) the
rounding alone flips calls. Here the served model (input scaling folded, every output export converts) is
wrapped with TensorFlow Model Optimization's fake quantization (each layer the default 8-bit scheme knows;
others, such as the Rescaling, stay float and are calibrated by the converter as in ptq) and fine-tuned for
a few hundred steps on train-split films, the float model's own probabilities as the target. The goal is
agreement with that model, so no label is read: the student learns weights and activation ranges whose int8
rounding lands where the float model does. BatchNorm statistics stay fixed (its layers in inference mode)
and dropout is off, so the only thing trained is how the quantized graph matches the float one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import tensorflow as tf
import tensorflow_model_optimization as tfmot

from covidxray.edge.litert import CLASS_MAPS_OUTPUT

BATCH_SIZE = 16  # the steps' batch: small, as export runs on the board's own memory
PROGRESS_EVERY = 25  # steps between progress lines


def _annotated(served: tf.keras.Model) -> tf.keras.Model:
    """`served` with every layer the 8-bit scheme supports marked for quantization, BatchNorm frozen, dropout off."""
    registry = tfmot.quantization.keras.default_8bit.Default8BitQuantizeRegistry()

    def clone_layer(layer: tf.keras.layers.Layer) -> tf.keras.layers.Layer:
        config = layer.get_config()
        if isinstance(layer, tf.keras.layers.Dropout):
            config["rate"] = 0.0
        # Trainable BatchNorm would re-estimate its statistics on these few batches; frozen it runs in inference mode.
        config["trainable"] = not isinstance(layer, tf.keras.layers.BatchNormalization)
        clone = layer.__class__.from_config(config)
        # BatchNormalization is no registry entry: the scheme's layout transforms fold it into the convolution
        # before it, as the converter does, when both are marked.
        marked = registry.supports(layer) or isinstance(layer, tf.keras.layers.BatchNormalization)
        return tfmot.quantization.keras.quantize_annotate_layer(clone) if marked else clone

    annotated = tf.keras.models.clone_model(served, clone_function=clone_layer)
    annotated.set_weights(served.get_weights())
    return annotated


def _range_variables(student: tf.keras.Model) -> dict[str, dict[str, list[tf.Variable]]]:
    """Layer name -> {"output" | "pre_activation": that quantizer's [min, max] variables} for every activation
    quantizer (the weight quantizers take their weights' own range at every step)."""
    found: dict[str, dict[str, list[tf.Variable]]] = {}
    for wrapper in student.layers:
        for variable in getattr(wrapper, "non_trainable_weights", []) if hasattr(wrapper, "layer") else []:
            quantity, _, bound = variable.name.split("/")[-1].removesuffix(":0").rpartition("_")
            if quantity in ("output", "post_activation", "pre_activation") and bound in ("min", "max"):
                kind = "pre_activation" if quantity == "pre_activation" else "output"
                found.setdefault(wrapper.layer.name, {}).setdefault(kind, [None, None])
                found[wrapper.layer.name][kind][bound == "max"] = variable
    return found


def _calibrate(student: tf.keras.Model, served: tf.keras.Model, batches: Iterator[np.ndarray]) -> None:
    """Every activation range set to what the float model's tensor spans on the calibration films, as the
    post-training converter sets it. The scheme starts each range at [-6, 6] and moves it by an average with
    decay 0.999 a step: a few hundred steps would leave most of this model's ranges far from its tensors'."""
    ranges = _range_variables(student)
    taps = []
    for name, kinds in ranges.items():
        layer = served.get_layer(name)
        for kind in kinds:
            taps.append((name, kind, layer.output if kind == "output" else _pre_activation(layer)))
    observe = tf.keras.Model(served.inputs, [tensor for *_, tensor in taps])
    low = np.full(len(taps), np.inf)
    high = np.full(len(taps), -np.inf)
    for images in batches:
        values = observe(tf.constant(images, tf.float32), training=False)
        low = np.minimum(low, [float(tf.reduce_min(value)) for value in values])
        high = np.maximum(high, [float(tf.reduce_max(value)) for value in values])
    for (name, kind, _), lowest, highest in zip(taps, low, high, strict=True):
        bottom, top = ranges[name][kind]
        bottom.assign(min(lowest, 0.0))  # the range holds zero, as an int8 zero point needs
        top.assign(max(highest, 0.0))


def _pre_activation(layer: tf.keras.layers.Layer) -> tf.Tensor:
    """The layer's output before its activation, as a tensor of the served model's graph."""
    linear = layer.__class__.from_config({**layer.get_config(), "activation": "linear", "name": f"{layer.name}_linear"})
    tensor = linear(layer.input)
    linear.set_weights(layer.get_weights())
    return tensor


def _batches(films: np.ndarray, steps: int, seed: int = 0) -> Iterator[np.ndarray]:
    """`steps` batches of BATCH_SIZE films, each pass over `films` in a new (seeded) order."""
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(len(films)) for _ in range(-(-steps * BATCH_SIZE // len(films)))])
    for step in range(steps):
        yield films[order[step * BATCH_SIZE : (step + 1) * BATCH_SIZE]]


def _batched(films: np.ndarray) -> Iterator[np.ndarray]:
    return (films[start : start + BATCH_SIZE] for start in range(0, len(films), BATCH_SIZE))


def quantization_aware(
    served: tf.keras.Model,
    train_films: Callable[[int], np.ndarray],
    steps: int,
    learning_rate: float,
    calibration_films: int,
    say: Callable[[str], None],
) -> tf.keras.Model:
    """`served` (probabilities first) fine-tuned with fake int8 quantization to give its own float probabilities.

    `train_films(n)` gives about n train films (uint8) spread over the split: steps x BATCH_SIZE are read once
    (each film seen about once), the activation ranges are calibrated on `calibration_films` of them spread as
    evenly. The result has the same outputs in the same order; the class-map kernel is set to the fine-tuned
    last layer's again, so the maps stay that layer's Grad-CAM.
    """
    films = train_films(steps * BATCH_SIZE)
    with tfmot.quantization.keras.quantize_scope():
        student = tfmot.quantization.keras.quantize_apply(_annotated(served))
    _calibrate(student, served, _batched(films[:: max(1, len(films) // calibration_films)][:calibration_films]))
    # The class maps get no gradient (the loss reads the probabilities): they are set from the last layer after.
    tuned = [v for v in student.trainable_variables if not v.name.startswith(f"{CLASS_MAPS_OUTPUT}/")]
    optimizer = tf.keras.optimizers.Adam(learning_rate)
    kl_divergence = tf.keras.losses.KLDivergence()

    @tf.function
    def train_step(images: tf.Tensor) -> tf.Tensor:
        target = served(images, training=False)[0]
        with tf.GradientTape() as tape:
            loss = kl_divergence(target, student(images, training=True)[0])
        optimizer.apply_gradients(zip(tape.gradient(loss, tuned), tuned))
        return loss

    say(f"int8 (qat): fine-tuning {steps} steps of {BATCH_SIZE} train films, learning rate {learning_rate:g}")
    losses = []
    for step, images in enumerate(_batches(films, steps), 1):
        losses.append(float(train_step(tf.constant(images, tf.float32))))
        if step % PROGRESS_EVERY == 0 or step == steps:
            say(f"int8 (qat): step {step}/{steps}, distillation loss {np.mean(losses[-PROGRESS_EVERY:]):.5f}")
    _sync_class_maps(student, served.output_names[0])
    return student


def _sync_class_maps(student: tf.keras.Model, head: str) -> None:
    """The class maps are the last Dense layer's kernel as a 1x1 convolution (covidxray/export/class_maps.py)."""
    kernels = {
        wrapper.layer.name: weight
        for wrapper in student.layers
        if hasattr(wrapper, "layer")
        for weight in wrapper.weights
        if weight.name.split("/")[-1] == "kernel:0"
    }
    if CLASS_MAPS_OUTPUT in kernels and head in kernels:
        kernels[CLASS_MAPS_OUTPUT].assign(kernels[head][None, None])
