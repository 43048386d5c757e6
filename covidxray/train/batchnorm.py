"""Batch-normalisation statistics that fit the current weights, however short the run.

Why: a BatchNormalization layer normalises with the statistics of the batch
while training, but with its moving averages at inference. Keras' MobileNetV3
keeps those averages with momentum 0.999 (EfficientNet 0.99), so after the few
hundred optimizer steps of a small data set (or of a 35-board job, ~9 steps an
epoch) they are still mostly their initial values (mean 0, variance 1). The
weights have moved meanwhile, inference-mode activations drift layer after
layer, and the model puts every image in one class (measured: see
docs/training.md, "Why BN statistics are re-estimated").

Fix ("precise BN", Wu & Johnson 2021): before each validation, every BN
layer's moving mean and variance are replaced by the plain average of the
batch statistics over a fixed number of training images, computed with the
current weights. Under Horovod each rank measures its own batches and the
averages are combined, so all replicas end up with the same statistics.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import tensorflow as tf

from covidxray.train.distributed import World


def batchnorm_layers(model: tf.keras.Model) -> list[tf.keras.layers.BatchNormalization]:
    return [layer for layer in model.submodules if isinstance(layer, tf.keras.layers.BatchNormalization)]


def recompute_statistics(model: tf.keras.Model, batches: Iterable, world: World) -> int:
    """Set every BN layer's moving statistics to the mean batch statistics over `batches`; returns batches used here.

    Keras' BN updates `moving = m * moving + (1 - m) * batch`; with
    m = k / (k + 1) at the k-th batch (0-based) that is the running mean of
    the batch statistics. The model is called eagerly, so each call reads the
    momentum set just before it. Dropout is switched off meanwhile: its noise
    (EfficientNet's drop-connect) is absent at inference.
    """
    norms = batchnorm_layers(model)
    if not norms:
        return 0
    momenta = [layer.momentum for layer in norms]
    frozen = [not layer.trainable for layer in norms]
    for layer in norms:  # a frozen (trainable=False) BN layer would normalise with its moving statistics and keep them
        layer.trainable = True
    dropouts = [layer for layer in model.submodules if isinstance(layer, tf.keras.layers.Dropout)]
    rates = [layer.rate for layer in dropouts]
    for layer in dropouts:
        layer.rate = 0.0
    used = 0
    try:
        for images, _ in batches:
            for layer in norms:
                layer.momentum = used / (used + 1)
            model(images, training=True)
            used += 1
    finally:
        for layer, momentum, was_frozen in zip(norms, momenta, frozen):
            layer.momentum, layer.trainable = momentum, not was_frozen
        for layer, rate in zip(dropouts, rates):
            layer.rate = rate
    _average_over_ranks(norms, used, world)
    return used


def _average_over_ranks(norms: list, used: int, world: World) -> None:
    """Weight each rank's estimate by its batch count, so every rank holds the same statistics."""
    mine = (used, [(layer.moving_mean.numpy(), layer.moving_variance.numpy()) for layer in norms])
    gathered = [g for g in world.allgather_object(mine) if g[0] > 0]
    if len(gathered) <= 1:
        return
    total = sum(count for count, _ in gathered)
    for i, layer in enumerate(norms):
        layer.moving_mean.assign(sum(count * stats[i][0] for count, stats in gathered) / total)
        layer.moving_variance.assign(sum(count * stats[i][1] for count, stats in gathered) / total)


def freeze_batchnorm(model: tf.keras.Model) -> None:
    """Every BN layer in inference mode: it normalises with its moving statistics, which training no longer changes.

    Why: with 16 images per rank (a Pi cluster) the batch statistics are noisy,
    and a pretrained backbone's features are already normalised; frozen
    statistics (measured once on the training X-rays, see trainer) make
    training and inference normalise alike. Must run before `compile`.
    """
    for layer in batchnorm_layers(model):
        layer.trainable = False


def batches_per_rank(images: int, batch_size: int, world_size: int) -> int:
    """Each rank's share of the `images` used to re-estimate the statistics (at least one batch)."""
    return max(1, math.ceil(images / (batch_size * world_size)))
