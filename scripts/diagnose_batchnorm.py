"""Is a collapsed model's BatchNormalization the cause? Compare a trained run's val predictions in inference
mode (BN moving statistics) and training mode (each batch's own statistics), and the moving statistics of
the backbone's BN layers with the statistics of a real batch.

    .venv/bin/python scripts/diagnose_batchnorm.py RUN_DIR DATA_DIR

The figures in docs/training.md ("A constant predictor, and why") come from this script.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

from covidxray.export.keras_file import load_keras_model
from covidxray.manifest import open_prepared
from covidxray.train.batchnorm import batchnorm_layers
from covidxray.train.input import InputSpec, make_dataset


def main(run_dir: str, data_dir: str) -> None:
    data = open_prepared(data_dir)
    size, classes = data.manifest.image_size, len(data.manifest.labels)
    model = load_keras_model(Path(run_dir) / "model.keras")  # safe mode, no code from the file
    dataset, _ = make_dataset(data.shards("val"), InputSpec(size, classes, 64))
    inference, truth = [], []
    for images, one_hot in dataset:
        inference.append(model(images, training=False).numpy())
        truth.append(np.argmax(one_hot, 1))
    norms = batchnorm_layers(model)
    moving = {
        layer.name: (layer.moving_mean.numpy(), layer.moving_variance.numpy()) for layer in norms
    }  # before training-mode calls update them
    training = [model(images, training=True).numpy() for images, _ in dataset]  # each batch's own statistics
    inference, training, truth = map(np.concatenate, (inference, training, truth))
    print(f"val images {truth.size}, majority share {np.bincount(truth).max() / truth.size:.4f}")
    for name, probabilities in (
        ("inference mode (moving statistics)", inference),
        ("training mode (batch statistics)", training),
    ):
        predicted = probabilities.argmax(1)
        print(
            f"{name}: accuracy {np.mean(predicted == truth):.4f}, predicted per class {np.bincount(predicted, minlength=classes).tolist()}"
        )
    print(f"BN layers {len(norms)}, momentum {sorted({layer.momentum for layer in norms})}")
    backbone = next((layer for layer in model.layers if isinstance(layer, tf.keras.Model)), None)
    if backbone is None:
        return
    inner = [layer for layer in backbone.layers if isinstance(layer, tf.keras.layers.BatchNormalization)]
    probe = tf.keras.Model(backbone.input, [layer.input for layer in inner])
    images, _ = next(iter(dataset))
    activations = probe(tf.concat([images] * 3, -1), training=True)  # each layer's input under batch statistics
    for layer, values in list(zip(inner, activations))[:: max(1, len(inner) // 8)]:
        values = values.numpy().reshape(-1, values.shape[-1])
        print(
            f"{layer.name:36s} batch mean {np.abs(values.mean(0)).mean():8.4f} moving mean {np.abs(moving[layer.name][0]).mean():8.4f} | "
            f"batch var {values.var(0).mean():9.4f} moving var {moving[layer.name][1].mean():9.4f}"
        )


if __name__ == "__main__":
    main(*sys.argv[1:3])
