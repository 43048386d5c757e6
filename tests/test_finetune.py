"""Fine-tuning a pretrained backbone: frozen BatchNorm statistics, measured once, then fixed.

Oracles: numpy's mean and variance of the very activations the BN layer sees,
and the saved checkpoints themselves (statistics identical after each epoch
while the weights move).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from conftest import run_cli

from covidxray.train.batchnorm import freeze_batchnorm, recompute_statistics
from covidxray.train.distributed import World


def _conv_bn_model() -> tf.keras.Model:
    inputs = tf.keras.layers.Input((8, 8, 1))
    conv = tf.keras.layers.Conv2D(4, 3, padding="same", name="conv")(inputs)
    outputs = tf.keras.layers.BatchNormalization(name="bn")(conv)
    pooled = tf.keras.layers.GlobalAveragePooling2D()(outputs)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(2, activation="softmax")(pooled))


def test_frozen_statistics_are_the_mean_batch_statistics_and_training_keeps_them():
    tf.keras.utils.set_random_seed(0)
    model = _conv_bn_model()
    freeze_batchnorm(model)
    model.compile(optimizer=tf.keras.optimizers.Adam(0.1), loss="categorical_crossentropy")
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, (16, 8, 8, 1)).astype(np.float32) for _ in range(3)]
    recompute_statistics(model, [(b, None) for b in batches], World())

    conv = tf.keras.Model(model.inputs, model.get_layer("conv").output)
    activations = [conv(b).numpy().reshape(-1, 4) for b in batches]
    bn = model.get_layer("bn")
    np.testing.assert_allclose(bn.moving_mean.numpy(), np.mean([a.mean(0) for a in activations], 0), rtol=1e-4)
    np.testing.assert_allclose(bn.moving_variance.numpy(), np.mean([a.var(0) for a in activations], 0), rtol=1e-3)
    assert not bn.trainable

    before = [w.numpy().copy() for w in bn.weights]
    kernel_before = model.get_layer("conv").kernel.numpy().copy()
    labels = np.eye(2)[rng.integers(0, 2, 16)]
    model.fit(batches[0], labels, epochs=3, verbose=0)
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(before, bn.weights))  # gamma, beta and statistics
    assert not np.array_equal(kernel_before, model.get_layer("conv").kernel.numpy())  # while the convolution learnt


@pytest.mark.slow
def test_train_with_frozen_batchnorm_measures_once_and_keeps_the_statistics(synthetic_data, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli(
        "train",
        "--data-dir",
        str(synthetic_data),
        "--run-dir",
        str(run_dir),
        "--model",
        "efficientnet_lite0",
        "--epochs",
        "2",
        "--set",
        "train.freeze_batchnorm=true",
        "--set",
        "train.bn_recalibration_images=64",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("measuring the frozen BN statistics on 64 training images") == 1

    def statistics(epoch: int) -> tuple[np.ndarray, np.ndarray]:
        (folder,) = (run_dir / "checkpoints").glob(f"epoch-{epoch:04d}-*")
        reader = tf.train.load_checkpoint(str(folder / "ckpt"))
        names = sorted(n for n in reader.get_variable_to_shape_map() if "moving_mean" in n or "kernel" in n)
        means = np.concatenate([reader.get_tensor(n).ravel() for n in names if "moving_mean" in n])
        kernels = np.concatenate([reader.get_tensor(n).ravel() for n in names if "kernel" in n])
        return means, kernels

    means_1, kernels_1 = statistics(1)
    means_2, kernels_2 = statistics(2)
    assert np.array_equal(means_1, means_2) and np.abs(means_1).sum() > 0  # measured (not Keras' zeros), then fixed
    assert not np.array_equal(kernels_1, kernels_2)


def layers_moved_by_training(frozen_stages: int) -> tuple[set[str], set[str]]:
    """Names of efficientnet_lite0's layers with weights, and of those two epochs of training changed."""
    from covidxray.config import TrainConfig
    from covidxray.train.finetune import hold_fixed
    from covidxray.train.models import build_model

    tf.keras.utils.set_random_seed(0)
    model = build_model("efficientnet_lite0", 32, 2)
    hold_fixed(model, TrainConfig(model="efficientnet_lite0", frozen_stages=frozen_stages))
    model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="categorical_crossentropy")
    before = {layer.name: [w.copy() for w in layer.get_weights()] for layer in model.layers if layer.weights}
    rng = np.random.default_rng(0)
    model.fit(rng.uniform(0, 255, (8, 32, 32, 1)), np.eye(2)[rng.integers(0, 2, 8)], epochs=2, verbose=0)
    moved = {
        name
        for name, weights in before.items()
        if any(not np.array_equal(a, b) for a, b in zip(weights, model.get_layer(name).get_weights()))
    }
    return set(before), moved


def test_frozen_stages_keep_their_weights_while_the_rest_learns():
    from covidxray.train.efficientnet_lite import stage_of

    names, moved = layers_moved_by_training(4)
    frozen = {name for name in names if stage_of(name) is not None and stage_of(name) < 4}
    learning = {name for name in names if name.endswith("conv") and (stage_of(name) or 0) >= 4}
    assert frozen and learning
    assert not frozen & moved  # kernels and BN statistics alike
    assert learning <= moved


def test_every_stage_frozen_leaves_the_classifier_alone_to_learn():
    """`train.frozen_stages` at its maximum (all of the backbone's stages): a linear model of the ImageNet features."""
    from covidxray.config import ConfigError, load_config
    from covidxray.train.efficientnet_lite import STAGE_COUNT

    assert load_config(None, [{"train": {"frozen_stages": STAGE_COUNT}}]).train.frozen_stages == STAGE_COUNT
    with pytest.raises(ConfigError, match=f"train.frozen_stages: {STAGE_COUNT + 1} is above the maximum {STAGE_COUNT}"):
        load_config(None, [{"train": {"frozen_stages": STAGE_COUNT + 1}}])
    _, moved = layers_moved_by_training(STAGE_COUNT)
    assert moved == {"probabilities"}


def test_frozen_stages_need_a_staged_model():
    from covidxray.config import ConfigError, TrainConfig, load_config
    from covidxray.errors import UserError
    from covidxray.train.finetune import hold_fixed
    from covidxray.train.models import build_model

    with pytest.raises(UserError, match="train.frozen_stages: 2 needs a model with named stages"):
        hold_fixed(build_model("small_cnn", 32, 2), TrainConfig(model="small_cnn", frozen_stages=2))
    with pytest.raises(ConfigError, match="train.frozen_stages: -1 is below the minimum 0"):
        load_config(None, [{"train": {"frozen_stages": -1}}])
