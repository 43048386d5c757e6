"""Every registered model, export format and source against its contract, looped over the registries.

A new entry is tested the moment it is registered (as timm's tests parametrize over `list_models`): a model
that takes colour input, lacks its `probabilities` head or does not quantise fails here; a source that is
registered without a tiny layout below fails `test_every_registered_source_has_a_layout_here`.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from layouts import build_ieee8023, build_kaggle, build_mendeley_v2, build_talo

from covidxray.config import ConfigError
from covidxray.export.formats import FORMATS
from covidxray.records import HARMONISED_LABELS, IMAGE_SUFFIXES, Dropped, Record
from covidxray.sources import SOURCE_REGISTRY, build_source
from covidxray.train.models import MODEL_REGISTRY

SIZE, CLASSES = 32, 3  # the smallest input every registered backbone accepts (Keras applications: 32 px)
LABELS = ["a", "b", "c"]
# Models whose build plus SavedModel plus int8 conversion takes more than ~20 s on the 2-core CI machine.
SLOW_MODELS = {"efficientnet_b0", "efficientnet_lite0", "mobilenet_v3_small"}


def gray_images(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 255, (count, SIZE, SIZE, 1)).astype(np.float32)


def lite_classifier(model, fmt: str, folder: Path):
    """`model` through export's own steps (served graph, SavedModel, converter of `fmt`) and the LiteRT
    classifier predict uses, with export's pre-fit card (labels and size only)."""
    from covidxray.edge.litert import TFLiteClassifier
    from covidxray.export.class_maps import served_model
    from covidxray.export.tflite import convert, write_saved_model

    saved = write_saved_model(served_model(model), folder)
    representative = gray_images(4, seed=1) if FORMATS.get(fmt).needs_representative else None
    flatbuffer = convert(saved, fmt, representative)
    card = {"labels": LABELS, "image_size": SIZE}
    return TFLiteClassifier(folder / f"model-{fmt}.tflite", flatbuffer=flatbuffer, card=card)


def assert_class_maps_are_gradcam(model, images, class_maps, atol=1e-4) -> None:
    """Each class's map, cut at 0 and scaled to a peak of 1, equals the Keras Grad-CAM of covidxray/export/gradcam.py."""
    from covidxray.edge.class_maps import heat_map
    from covidxray.export.gradcam import heatmap, score_function

    forward = score_function(model)
    for image, maps in zip(images[:2], class_maps[:2]):
        for class_index in range(maps.shape[-1]):
            np.testing.assert_allclose(heat_map(maps, class_index), heatmap(forward, image, class_index), atol=atol)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_MODELS else n for n in MODEL_REGISTRY.names()]
)
def test_every_registered_model_meets_the_model_contract_and_quantises(name, tmp_path):
    tf = pytest.importorskip("tensorflow")
    from covidxray.export.class_maps import served_model
    from covidxray.train.models import build_model

    model = build_model(name, SIZE, CLASSES)
    assert model.input_shape == (None, SIZE, SIZE, 1)  # one gray channel, as prepare writes it
    head = model.get_layer("probabilities")
    assert isinstance(head, tf.keras.layers.Dense) and head.get_config()["activation"] == "softmax"
    assert model.output_shape == (None, CLASSES) and model.layers[-1] is head
    images = gray_images(6)
    probabilities = model.predict(images, verbose=0)
    np.testing.assert_allclose(probabilities.sum(1), 1.0, atol=1e-5)

    served_probabilities, embedding, *class_maps = served_model(model)(images, training=False)
    np.testing.assert_allclose(served_probabilities, probabilities, atol=1e-5)
    assert embedding.shape == (6, head.input_shape[-1])  # what feeds the head, for the OOD fit
    # Grad-CAM without TensorFlow on the board for every model with global average pooling (all but small_cnn)
    assert len(class_maps) == (name != "small_cnn")
    if class_maps:
        assert_class_maps_are_gradcam(model, images, class_maps[0].numpy())

    classifier = lite_classifier(model, "int8", tmp_path)
    lite_probabilities, lite_embedding = classifier.infer(images[0])
    assert lite_probabilities.shape == (CLASSES,) and lite_embedding is not None
    assert lite_embedding.shape == (head.input_shape[-1],)
    # uint8 probabilities: each within half a quantisation step of its true value, so the sum within n of them
    assert abs(lite_probabilities.sum() - 1.0) <= CLASSES * classifier.probability_floor + 1e-6


@pytest.mark.parametrize("fmt", FORMATS.names())
def test_every_registered_format_converts_a_model_that_litert_runs_like_keras(fmt, tmp_path):
    pytest.importorskip("tensorflow")
    from covidxray.train.models import build_model

    model = build_model("small_cnn", SIZE, CLASSES)
    images = gray_images(8, seed=2)
    keras_probabilities = model.predict(images, verbose=0)
    classifier = lite_classifier(model, fmt, tmp_path)
    lite = np.stack([classifier.infer(image)[0] for image in images])
    assert lite.shape == keras_probabilities.shape
    # Loose enough for int8 (a few steps of 1/256 through the network), tight enough to catch a converter that
    # reads pixels on another scale or swaps outputs (an untrained head's probabilities differ by ~0.1-0.3).
    assert np.abs(lite - keras_probabilities).max() < 0.05
    assert FORMATS.describe(fmt)  # listed with a description by `covidxray formats`


def _kermany_chest(base: Path):
    chest, _ = build_mendeley_v2(base)
    return {"version": 2}, chest


# Each registered source's tiny copy (tests/layouts.py): options beside from_path, and the Layout it must give
# (None: the source makes its own data).
SOURCE_LAYOUTS = {
    "covid-chestxray": lambda base: ({}, build_ieee8023(base)),
    "chest-xray-pneumonia": lambda base: ({}, build_kaggle(base)),
    "kermany": _kermany_chest,
    "covid19-talo": lambda base: ({}, build_talo(base)),
    "synthetic": lambda base: ({"patients": 6, "image_size": 32}, None),
}


def test_every_registered_source_has_a_layout_here():
    assert sorted(SOURCE_LAYOUTS) == sorted(SOURCE_REGISTRY.names())


@pytest.mark.parametrize("name", SOURCE_REGISTRY.names())
def test_every_registered_source_meets_the_record_contract(name, tmp_path):
    options, layout = SOURCE_LAYOUTS[name](tmp_path / "given")
    if layout is not None:
        options = {**options, "from_path": str(layout.root)}
    source = build_source(name, options)
    assert set(options) <= set(source.option_names())
    assert f"Options: {', '.join(source.option_names())}." in SOURCE_REGISTRY.describe(name)
    root, provenance = source.fetch(tmp_path / "cache")
    items = list(source.records(root))
    records = [item for item in items if isinstance(item, Record)]
    assert records and all(isinstance(item, (Record, Dropped)) for item in items)
    for record in records:
        assert record.source == name
        # namespaced by a source, so ids never collide across sources (talo's ieee8023 copies keep their
        # covid-chestxray patients, so that both copies of one patient split together)
        assert record.patient_id.split(":", 1)[0] in SOURCE_REGISTRY
        assert record.label in HARMONISED_LABELS
        assert record.image.is_file() and record.image.suffix.lower() in IMAGE_SUFFIXES
    assert all(item.reason for item in items if isinstance(item, Dropped))
    assert all(value is None or isinstance(value, str) for value in provenance.values())  # JSON for the manifest
    if layout is not None:  # the layout's own row-by-row declaration is the oracle
        # a described collection says where it came from, and under which licence
        assert provenance["licence"] and provenance["from"] == str(layout.root)
        assert {r.image.name: r.label for r in records} == layout.labels
        assert {r.image.name: r.patient_id for r in records} == layout.patients
        assert Counter(item.reason for item in items if isinstance(item, Dropped)) == layout.dropped


@pytest.mark.parametrize("name", SOURCE_REGISTRY.names())
def test_every_registered_source_refuses_an_unknown_option_by_name(name):
    with pytest.raises(ConfigError, match=rf"data\.sources\.{name}.*unknown key"):
        build_source(name, {"no_such_option": 1})


def test_an_adapter_missing_a_contract_method_is_refused_when_built():
    from covidxray.sources import Source

    class NoLayoutCheck(Source):
        name = "no-layout-check"

        def fetch(self, cache_dir):
            raise AssertionError("never reached")

        def records(self, root):
            return iter(())

    with pytest.raises(TypeError, match="is_root"):
        NoLayoutCheck()
