"""export.int8_method mixed (covidxray/export/mixed_int8.py): int8 with the layers it rounds worst kept in float.

The oracles are TensorFlow Lite's own interpreter reading the .tflite's tensor types (which layers are float,
what the interface is) and its answers on real films against the Keras model's, counted here, not by export.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import copy_trained_model, int8_argmax, near_tie_model, run_cli

SIZE, CLASSES = 64, 3


def _tensor_types(flatbuffer: bytes) -> dict[str, type]:
    import tensorflow as tf

    return {t["name"]: t["dtype"] for t in tf.lite.Interpreter(model_content=flatbuffer).get_tensor_details()}


def _int8_probabilities(flatbuffer: bytes, images: np.ndarray) -> np.ndarray:
    """The build's probabilities (uint8 out, dequantized with the output's own scale and zero point)."""
    import tensorflow as tf

    runner = tf.lite.Interpreter(model_content=flatbuffer).get_signature_runner()
    scale, zero = runner.get_output_details()["probabilities"]["quantization"]
    raw = np.stack([runner(image=image[None].astype(np.uint8))["probabilities"][0] for image in images])
    return (raw.astype(np.float32) - zero) * scale


def _output_type(types: dict[str, type], layer: str) -> type:
    """The type of the op's output tensor: its name is the fused names of what the op computes, `layer` last."""
    (found,) = {kind for name, kind in types.items() if name == layer or name.endswith(f";{layer}")}
    return found


@pytest.mark.slow
def test_mixed_int8_keeps_the_measured_layers_float_and_is_closer_to_keras_than_ptq(shared_data, tmp_path):
    import tensorflow as tf

    from covidxray.config import ExportConfig
    from covidxray.export.tflite import convert, convert_as_set, write_saved_model

    served, train, test, keras = near_tie_model(shared_data, SIZE, CLASSES)
    saved = write_saved_model(served, tmp_path / "saved")
    ptq = convert(saved, "int8", train)
    settings = ExportConfig(int8_method="mixed", int8_float_layers=2)
    mixed, made = convert_as_set(saved, "int8", train, settings, print)

    layers = [entry.split(" ")[1] for entry in made["float_layers"]]
    assert len(layers) == 2
    mixed_types, ptq_types = _tensor_types(mixed), _tensor_types(ptq)
    assert [_output_type(mixed_types, layer) for layer in layers] == [np.float32, np.float32]
    assert [_output_type(ptq_types, layer) for layer in layers] == [np.int8, np.int8]
    # Nothing else is float: each kept op has at most four float tensors (its output, its input dequantized, its
    # kernel, its bias), and the ptq build none at all.
    assert not [name for name, kind in ptq_types.items() if kind == np.float32]
    assert 2 <= len([name for name, kind in mixed_types.items() if kind == np.float32]) <= 4 * len(layers)
    runner = tf.lite.Interpreter(model_content=mixed).get_signature_runner()
    assert runner.get_input_details()["image"]["dtype"] == np.uint8  # the same interface as ptq: uint8 pixels in
    assert runner.get_output_details()["probabilities"]["dtype"] == np.uint8

    # The layers kept float are the ones int8 rounds worst, so the mixed build's probabilities are closer to Keras'.
    # Agreement (argmax) is printed, not asserted: on this untrained head a tenth of the films are near-ties, and
    # one flips either way (mixed 91.41% against ptq 92.19% here once); on the real trained runs mixed agrees on
    # more (docs/benchmarks.md §6, measured by `covidxray export`).
    reference = served.predict(test, verbose=0)[0]
    ptq_error = np.abs(_int8_probabilities(ptq, test) - reference).mean()
    mixed_error = np.abs(_int8_probabilities(mixed, test) - reference).mean()
    ptq_agreement = (int8_argmax(ptq, test) == keras).mean()
    mixed_agreement = (int8_argmax(mixed, test) == keras).mean()
    print(
        f"int8 against Keras on {len(test)} real films: mean |dp| ptq {ptq_error:.4f}, mixed {mixed_error:.4f}; "
        f"agreement ptq {ptq_agreement:.2%}, mixed {mixed_agreement:.2%}"
    )
    assert mixed_error < ptq_error


@pytest.mark.slow
def test_mixed_export_reports_its_float_layers_and_writes_no_c_array(trained_run, synthetic_data, tmp_path):
    from covidxray.edge.litert import TFLiteClassifier

    run_dir = copy_trained_model(trained_run, tmp_path / "run")
    args = ["--run-dir", str(run_dir), "--data-dir", str(synthetic_data), "--format", "int8"]
    mixed = ["--set", "export.int8_method=mixed", "--set", "export.int8_min_agreement=0"]
    assert run_cli("export", *args, "--set", "export.int8_min_agreement=0").returncode == 0
    assert (run_dir / "model-int8.cc").exists()  # the ptq build's C array, which the mixed export must not leave

    refused = run_cli("export", *args, *mixed, "--c-array")
    assert refused.returncode == 2 and "--c-array needs an integer-only int8 build" in refused.stderr
    assert "Traceback" not in refused.stderr

    result = run_cli("export", *args, *mixed, "--set", "export.int8_float_layers=3")
    assert result.returncode == 0, result.stderr[-3000:]
    entry = json.loads((run_dir / "export_report.json").read_text())["int8"]
    assert entry["method"] == "mixed" and len(entry["float_layers"]) == 3
    assert entry["c_array"] == [] and "integer-only" in entry["c_array_note"]
    assert not (run_dir / "model-int8.cc").exists() and not (run_dir / "model-int8.h").exists()
    classifier = TFLiteClassifier(run_dir / "model-int8.tflite")  # as predict reads it
    probabilities, embedding = classifier.infer(np.full((64, 64, 1), 128, np.float32))
    assert probabilities.shape == (len(classifier.labels),) and embedding is not None
