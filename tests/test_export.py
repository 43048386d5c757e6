"""Issue 5: `covidxray export` -- SavedModel -> TFLite float32/float16/int8, parity report, sidecar, C array."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess

import numpy as np
import pytest
from conftest import copy_trained_model, run_cli

from covidxray.export.formats import FORMATS

EVERY_FORMAT = FORMATS.names()  # all_formats_run exports each registered format


def one_line(text: str) -> str:
    """CLI errors go through rich, which wraps long lines when stderr is not a terminal."""
    return " ".join(text.split())


def parse_c_array(source: str) -> tuple[bytes, int]:
    """The bytes inside `g_model[] = {...}` and the declared `g_model_len`."""
    body = re.search(r"alignas\(16\) const unsigned char g_model\[\] = \{(.*?)\};", source, re.S).group(1)
    length = int(re.search(r"const unsigned int g_model_len = (\d+);", source).group(1))
    return bytes(int(h, 16) for h in re.findall(r"0x([0-9a-f]{2})", body)), length


def test_every_format_agrees_with_keras_and_sizes_shrink(all_formats_run):
    from covidxray.config import ExportConfig

    report = json.loads((all_formats_run / "export_report.json").read_text())
    assert report["float32"]["agreement"] >= 0.99
    assert report["float16"]["agreement"] >= 0.98
    assert report["int8"]["agreement"] >= ExportConfig().int8_min_agreement
    assert report["int8"]["meets_bar"] is True
    sizes = [report[fmt]["bytes"] for fmt in ("float32", "float16", "int8")]
    assert sizes[2] < sizes[1] < sizes[0]
    for fmt in EVERY_FORMAT:
        entry = report[fmt]
        assert entry["bytes"] == (all_formats_run / entry["file"]).stat().st_size
        assert entry["accuracy_delta"] == pytest.approx(entry["accuracy"] - report["keras"]["accuracy"])
    assert report["test_images"] > 0 and report["int8_min_agreement"] == ExportConfig().int8_min_agreement
    card = json.loads((all_formats_run / "model.json").read_text())
    assert report["data_is_training_data"] is True and report["dataset_id"] == card["dataset_id"]


def test_report_agreement_matches_an_independent_check(all_formats_run, synthetic_data):
    import tensorflow as tf

    from covidxray.edge.litert import TFLiteClassifier
    from covidxray.export.tflite import load_split
    from covidxray.manifest import open_prepared

    images, labels = load_split(open_prepared(synthetic_data), "test")
    keras = (
        tf.keras.models.load_model(str(all_formats_run / "model.keras"), compile=False)
        .predict(images, verbose=0)
        .argmax(1)
    )
    report = json.loads((all_formats_run / "export_report.json").read_text())
    lite = TFLiteClassifier(all_formats_run / "model-int8.tflite").predict(images).argmax(1)
    assert report["int8"]["agreement"] == pytest.approx((lite == keras).mean())
    assert report["int8"]["accuracy"] == pytest.approx((lite == labels).mean())


def test_int8_model_takes_and_gives_uint8(all_formats_run):
    from covidxray.edge.litert import TFLiteClassifier

    classifier = TFLiteClassifier(all_formats_run / "model-int8.tflite")
    assert classifier.input["dtype"] == np.uint8 and classifier.output["dtype"] == np.uint8
    assert TFLiteClassifier(all_formats_run / "model-float32.tflite").input["dtype"] == np.float32


def test_sidecar_carries_everything_predict_needs(all_formats_run, synthetic_data):
    from covidxray.edge.preprocess import PREPROCESSING_VERSION

    manifest = json.loads((synthetic_data / "manifest.json").read_text())
    # the data set's id: sha256 of sorted compact JSON of what training reads (covidxray/manifest.py open_prepared)
    identity = {k: manifest[k] for k in ("task", "labels", "image_size", "preprocessing", "shards")}
    dataset_id = hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    for fmt in EVERY_FORMAT:
        model = all_formats_run / f"model-{fmt}.tflite"
        card = json.loads(model.with_suffix(".json").read_text())
        assert card["labels"] == manifest["labels"]
        assert card["image_size"] == manifest["image_size"]
        assert card["preprocessing"] == PREPROCESSING_VERSION
        assert card["dataset_id"] == dataset_id and "manifest_sha256" not in card
        assert card["tflite_sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
        assert card["format"] == fmt and card["keras_model"] == "model.keras"
        assert set(card["parity"]) >= {"agreement", "accuracy", "accuracy_delta", "test_images"}


def test_conversion_went_through_a_saved_model(all_formats_run):
    import tensorflow as tf

    saved = tf.saved_model.load(str(all_formats_run / "saved_model"))
    signature = saved.signatures["serving_default"]
    (spec,) = signature.structured_input_signature[1].values()
    assert spec.shape.as_list()[1:] == [64, 64, 1]


def test_c_array_holds_exactly_the_int8_model(all_formats_run):
    tflite = (all_formats_run / "model-int8.tflite").read_bytes()
    source = (all_formats_run / "model-int8.cc").read_text()
    header = (all_formats_run / "model-int8.h").read_text()
    data, length = parse_c_array(source)
    assert data == tflite and length == len(tflite)
    assert '#include "model-int8.h"' in source
    assert "extern const unsigned char g_model[];" in header and "constexpr int kModelImageSize = 64;" in header
    assert '{"normal", "pneumonia", "covid-19"}' in source


def test_c_array_compiles_with_external_linkage(tmp_path):
    """A tiny payload through the same writer, compiled: board code must be able to link g_model."""
    import shutil

    from covidxray.export.c_array import write_c_array

    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    fake = tmp_path / "model-int8.tflite"
    fake.write_bytes(bytes(range(256)) * 3 + b"\x01")
    source, _header = write_c_array(fake, ["normal", "covid-19"], 32)
    obj = tmp_path / "model.o"
    subprocess.run(["g++", "-std=c++17", "-c", str(source), "-o", str(obj)], check=True, capture_output=True)
    symbols = subprocess.run(["nm", "-C", str(obj)], check=True, capture_output=True, text=True).stdout
    for name in ("g_model", "g_model_len", "kModelLabels"):
        assert re.search(rf" [RD] {name}\b", symbols), symbols
    assert parse_c_array(source.read_text()) == (fake.read_bytes(), 769)


def test_int8_below_the_bar_fails_loudly(trained_run, synthetic_data, tmp_path):
    """A bar above any agreement; in-process, because the config loader rightly refuses a bar above 1."""
    from covidxray.config import load_config
    from covidxray.errors import UserError
    from covidxray.export.tflite import export

    run_dir = copy_trained_model(trained_run, tmp_path / "run")
    config = load_config(
        None,
        [
            {
                "data": {"data_dir": str(synthetic_data)},
                "train": {"run_dir": str(run_dir)},
                "export": {"formats": ["float16", "int8"]},
            }
        ],
    )
    config.export.int8_min_agreement = 1.01
    with pytest.raises(UserError) as refused:
        export(config, say=lambda _message: None)
    message = one_line(str(refused.value))
    assert "int8 model agrees with Keras on only" in message and "int8_min_agreement" in message
    report = json.loads((run_dir / "export_report.json").read_text())  # still written, for the post-mortem
    assert report["int8"]["meets_bar"] is False and "float16" in report


def test_unknown_format_is_a_user_error(tmp_path, synthetic_data):
    result = run_cli("export", "--run-dir", str(tmp_path), "--data-dir", str(synthetic_data), "--format", "int4")
    assert result.returncode == 2 and "int4" in one_line(result.stderr) and "Traceback" not in result.stderr


def test_every_format_has_named_probability_and_embedding_outputs(all_formats_run):
    from covidxray.edge.litert import TFLiteClassifier

    for fmt in EVERY_FORMAT:
        classifier = TFLiteClassifier(all_formats_run / f"model-{fmt}.tflite")
        assert list(classifier.output["shape"]) == [1, 3]
        assert list(classifier.embedding_output["shape"]) == [1, 512]  # small_cnn's Dense(512) feeds its head
        assert classifier.ood is not None and classifier.ood.means.shape == (3, 512)
    int8 = TFLiteClassifier(all_formats_run / "model-int8.tflite")
    assert int8.embedding_output["dtype"] == np.uint8


def test_sidecar_temperature_and_ood_threshold_are_what_val_says(all_formats_run, synthetic_data):
    """Independent recomputation: NLL minimum over T on val, and the largest val distance x the margin."""
    from covidxray.config import ExportConfig
    from covidxray.edge.litert import TFLiteClassifier
    from covidxray.export.calibration import LOG_T_BOUNDS
    from covidxray.export.tflite import load_split
    from covidxray.manifest import open_prepared

    images, labels = load_split(open_prepared(synthetic_data), "val")
    for fmt in ("float32", "int8"):
        classifier = TFLiteClassifier(all_formats_run / f"model-{fmt}.tflite")
        card = json.loads((all_formats_run / f"model-{fmt}.json").read_text())
        raw, embeddings = map(np.array, zip(*(classifier.infer(image) for image in images)))
        floor = 1e-7 if fmt == "float32" else classifier.output["quantization"][0] / 2

        def nll(t: float, raw=raw, floor=floor) -> float:  # this format's outputs, bound now
            logits = np.log(np.maximum(raw, floor)) / t
            log_softmax = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
            return float(-log_softmax[np.arange(len(labels)), labels].mean())

        t = card["temperature"]["value"]
        low, high = np.exp(LOG_T_BOUNDS)
        neighbours = [n for n in (t * 1.05, t / 1.05) if low <= n <= high]  # a minimum over the searched range
        assert t > 0 and nll(t) <= min(map(nll, neighbours)) + 1e-9, (fmt, t)
        assert card["temperature"]["at_search_bound"] == (len(neighbours) < 2)
        assert card["temperature"]["nll_after"] <= card["temperature"]["nll_before"] + 1e-9
        distances = []
        for e in embeddings:
            distances.append(
                min(float(np.sqrt((e - m) @ classifier.ood.precision @ (e - m))) for m in classifier.ood.means)
            )
        assert card["ood"]["threshold"] == pytest.approx(max(distances) * ExportConfig().ood_margin, rel=1e-5)
        assert card["ood"]["val_images"] == len(labels)
        report = json.loads((all_formats_run / "export_report.json").read_text())[fmt]
        assert report["temperature"] == t and 0 <= report["test_over_ood_threshold"] <= 0.05


def test_sidecar_layout_threshold_is_the_largest_val_score_times_the_margin(all_formats_run, synthetic_data):
    """Independent recomputation from the stored mean and precision: each val image shrunk to 12 px,
    standardised, Mahalanobis distance of it or of its negative, whichever is smaller; one fit for every format."""
    import base64

    import cv2

    from covidxray.config import ExportConfig
    from covidxray.export.tflite import load_split
    from covidxray.manifest import open_prepared

    images, _ = load_split(open_prepared(synthetic_data), "val")
    entry = json.loads((all_formats_run / "model-float32.json").read_text())["layout"]
    mean = np.frombuffer(base64.b64decode(entry["mean"]), "<f4").astype(np.float64)
    precision = np.frombuffer(base64.b64decode(entry["precision"]), "<f4").astype(np.float64).reshape(144, 144)

    def score(image: np.ndarray) -> float:
        small = cv2.resize(image[:, :, 0], (12, 12), interpolation=cv2.INTER_AREA).ravel().astype(np.float64)
        vector = (small - small.mean()) / small.std()
        return min(float(np.sqrt((v - mean) @ precision @ (v - mean))) for v in (vector, -vector))

    largest = max(score(image) for image in images)
    assert entry["threshold"] == pytest.approx(largest * ExportConfig().layout_margin, rel=1e-4)
    assert entry["val_images"] == len(images) and entry["val_score"]["max"] == pytest.approx(largest, rel=1e-4)
    report = json.loads((all_formats_run / "export_report.json").read_text())
    for fmt in ("float16", "int8"):
        assert json.loads((all_formats_run / f"model-{fmt}.json").read_text())["layout"] == entry
        assert report[fmt]["layout_threshold"] == entry["threshold"]
    assert 0 <= report["float32"]["test_over_layout_threshold"] <= 0.05
