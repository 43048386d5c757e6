"""Issue 24: source-balanced batches with class weights within each source, encoding degradation, the source adversary."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.utils.class_weight import compute_class_weight

from covidxray.config import ConfigError, load_config
from covidxray.manifest import Manifest, SplitSummary

LABELS = ["normal", "pneumonia", "covid-19"]
SOURCE_CLASSES = {
    "kaggle": {"normal": 300, "pneumonia": 900, "covid-19": 0},
    "ieee": {"normal": 10, "pneumonia": 40, "covid-19": 250},
    "talo": {"normal": 120, "pneumonia": 100, "covid-19": 0},
}


def _manifest(source_classes: dict) -> Manifest:
    sources = {s: sum(c.values()) for s, c in source_classes.items()}
    train = SplitSummary(records=sum(sources.values()), sources=sources, source_classes=source_classes)
    return Manifest(task="chest3", labels=LABELS, image_size=64, splits={"train": train})


def test_class_weights_within_each_source_are_sklearns_balanced_weights():
    from covidxray.train.source_balance import train_sources, within_source_weights

    manifest = _manifest(SOURCE_CLASSES)
    weights = within_source_weights(manifest, power=1.0)
    for row, source in zip(weights, train_sources(manifest)):
        counts = SOURCE_CLASSES[source]
        y = np.concatenate([np.full(counts[name], c) for c, name in enumerate(LABELS)])
        present = np.unique(y)
        expected = compute_class_weight("balanced", classes=present, y=y)
        np.testing.assert_allclose([row[c] for c in present], expected)
        # within the source every present class now carries the same total weight: the source says nothing of the class
        totals = [row[c] * counts[LABELS[c]] for c in present]
        np.testing.assert_allclose(totals, totals[0])


def test_source_aware_follows_the_config():
    from covidxray.train.source_balance import source_aware

    manifest = _manifest(SOURCE_CLASSES)
    plain = load_config().train
    assert source_aware(plain, manifest, source_input=False) is None
    adversary_only = source_aware(plain, manifest, source_input=True)
    assert adversary_only.shares is None and adversary_only.weights is None and adversary_only.source_input
    balanced = source_aware(load_config(None, [{"train": {"sampling": "by_source"}}]).train, manifest, False)
    assert balanced.sources == ("ieee", "kaggle", "talo")
    np.testing.assert_allclose(balanced.shares, np.array([300, 1200, 220]) / 1720)
    unweighted = load_config(None, [{"train": {"sampling": "by_source", "class_weights": False}}]).train
    cells = source_aware(unweighted, manifest, False).weights
    present = [
        cells[i][c] for i, s in enumerate(balanced.sources) for c, n in enumerate(LABELS) if SOURCE_CLASSES[s][n]
    ]
    assert set(present) == {1.0}


@pytest.mark.parametrize(
    "key, value", [("sampling", "random"), ("degrade", 1.5), ("degrade", -0.1), ("source_adversary", -1)]
)
def test_new_train_keys_are_range_checked_by_name(key, value):
    with pytest.raises(ConfigError, match=f"train.{key}"):
        load_config(None, [{"train": {key: value}}])


@pytest.fixture(scope="module")
def source_sorted_shards(tmp_path_factory):
    """Two sources written one after the other, as prepare orders records: 300 of 'a' (labels 0/1), 60 of 'b' (label 2)."""
    import cv2

    from covidxray.data.tfrecord import make_example, write_shard

    folder = tmp_path_factory.mktemp("sources")
    png = cv2.imencode(".png", np.full((8, 8), 128, np.uint8))[1].tobytes()
    examples = [make_example(png, i % 2, f"pa{i}", "a", f"a:{i}") for i in range(300)]
    examples += [make_example(png, 2, f"pb{i}", "b", f"b:{i}") for i in range(60)]
    paths = []
    for index in range(0, len(examples), 60):
        path = folder / f"train-{index // 60:05d}.tfrecord"
        write_shard(path, examples[index : index + 60])
        paths.append(path)
    return paths


def _batches(paths, by_source, shuffle_buffer, count=60, batch=24):
    from covidxray.train.input import InputSpec, make_dataset

    spec = InputSpec(8, 3, batch, training=True, shuffle_buffer=shuffle_buffer, seed=3, by_source=by_source, threads=1)
    ds, _ = make_dataset(paths, spec)
    return list(ds.take(count).as_numpy_iterator())


def test_by_source_batches_hold_every_source_in_proportion(source_sorted_shards):
    from covidxray.train.input import SourceAware

    weights = ((1.0, 2.0, 0.0), (0.0, 0.0, 3.0))
    aware = SourceAware(("a", "b"), shares=(300 / 360, 60 / 360), weights=weights, source_input=True)
    batches = _batches(source_sorted_shards, aware, shuffle_buffer=16)
    sources = np.stack([x["source"] for x, _, _ in batches])  # (batches, batch)
    labels = np.stack([y.argmax(1) for _, y, _ in batches])
    assert abs((sources == 1).mean() - 60 / 360) < 0.03  # 1,440 draws: 3 standard errors
    mixed = np.mean([(row == 1).any() and (row == 0).any() for row in sources])
    assert mixed > 0.9  # expected 0.987
    assert set(labels[sources == 1].tolist()) == {2} and set(labels[sources == 0].tolist()) == {0, 1}
    for x, y, w in batches:  # each image's weight is its (source, class) cell
        np.testing.assert_allclose(w, [weights[s][c] for s, c in zip(x["source"], y.argmax(1))])
    # the plain stream, same small buffer: the shards' source order survives, many batches hold one source only
    plain = _batches(source_sorted_shards, SourceAware(("a", "b"), source_input=True), shuffle_buffer=16)
    assert np.mean([len(set(x["source"].tolist())) == 2 for x, _ in plain]) < mixed - 0.2


def test_degradation_adds_what_a_collections_encoding_would():
    from covidxray.train.input import _augment_fn

    gray = np.full((64, 64, 1), 120, np.float32)
    centre = slice(20, 44)  # affine framing changes reach the border only
    plain, degraded = _augment_fn(1.0, 0.0), _augment_fn(1.0, 1.0)
    spread_plain = max(plain(gray)[centre, centre].std() for _ in range(20))
    spread_degraded = max(degraded(gray)[centre, centre].std() for _ in range(20))
    assert spread_plain == 0.0 and spread_degraded > 1.0  # noise and JPEG blocks on a flat film


def test_gradient_reversal_negates_and_scales_the_gradient():
    import tensorflow as tf

    from covidxray.train.source_adversary import ramp, reverse_gradient

    x = tf.constant([[1.0, -2.0, 3.0]])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = reverse_gradient(x, tf.constant(0.25))
        loss = tf.reduce_sum(y * tf.constant([[2.0, 3.0, 4.0]]))
    np.testing.assert_allclose(y.numpy(), x.numpy())  # identity going forward
    np.testing.assert_allclose(tape.gradient(loss, x).numpy(), [[-0.5, -0.75, -1.0]])
    assert float(ramp(tf.constant(0.0))) == 0.0 and float(ramp(tf.constant(1.0))) == pytest.approx(
        2 / (1 + np.exp(-10)) - 1
    )


def test_the_adversary_trains_a_source_head_and_saves_the_classifier_alone():
    import tensorflow as tf

    from covidxray.train.models import build_model
    from covidxray.train.source_adversary import SourceAdversary, inference_model, wrap

    tf.keras.utils.set_random_seed(0)
    classifier = build_model("small_cnn", 16, 3)
    assert wrap(classifier, 1, 0.5, 10) is classifier and wrap(classifier, 3, 0.0, 10) is classifier
    model = wrap(classifier, 2, 0.5, 10)
    assert isinstance(model, SourceAdversary) and inference_model(model) is classifier
    model.compile(optimizer=tf.keras.optimizers.Adam(1e-3), loss="categorical_crossentropy", metrics=["accuracy"])
    rng = np.random.default_rng(0)
    source = rng.integers(0, 2, 64)
    images = (rng.random((64, 16, 16, 1)) * 60 + 150 * source[:, None, None, None]).astype(np.float32)
    labels = np.eye(3)[rng.integers(0, 3, 64)]
    head_before = [w.numpy().copy() for w in model.head.weights]
    history = model.fit({"image": images, "source": source}, labels, batch_size=16, epochs=2, verbose=0).history
    assert {"loss", "accuracy", "source_loss", "source_accuracy"} <= set(history)
    assert any(not np.allclose(a, b.numpy()) for a, b in zip(head_before, model.head.weights))
    # the model's weights are the classifier's and the head's only: per-rank metric state would make the replicas
    # of a Horovod job differ in their weights, checkpoints and digest
    assert [w.name for w in model.weights] == [w.name for w in classifier.weights + model.head.weights]
    np.testing.assert_allclose(model.predict(images, verbose=0), classifier.predict(images, verbose=0), rtol=1e-5)
    copy = tf.keras.models.clone_model(inference_model(model))  # what the trainer saves: no head inside
    assert [layer.name for layer in copy.layers] == [layer.name for layer in classifier.layers]
