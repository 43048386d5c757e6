"""export.int8_method mixed (covidxray/export/mixed_int8.py): int8 with the layers it rounds worst kept in float.

The oracle is TensorFlow Lite's own interpreter reading the .tflite's tensor types (which layers are float, what
the interface is) and the run folder export leaves. Whether mixed agrees with Keras more than ptq is a property
of the trained model: measured on the real runs by `covidxray export` (docs/benchmarks.md §6), not here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import copy_trained_model, near_tie_model, run_cli

SIZE, CLASSES = 64, 3


def _tensor_types(flatbuffer: bytes) -> dict[str, type]:
    import tensorflow as tf

    return {t["name"]: t["dtype"] for t in tf.lite.Interpreter(model_content=flatbuffer).get_tensor_details()}


def _output_type(types: dict[str, type], layer: str) -> type:
    """The type of the op's output tensor: its name is the fused names of what the op computes, `layer` last."""
    (found,) = {kind for name, kind in types.items() if name == layer or name.endswith(f";{layer}")}
    return found


@pytest.mark.slow
def test_mixed_int8_keeps_the_measured_layers_float_behind_the_uint8_interface(shared_data, tmp_path):
    import tensorflow as tf

    from covidxray.config import ExportConfig
    from covidxray.export.tflite import convert, convert_as_set, write_saved_model

    served, train, _, _ = near_tie_model(shared_data, SIZE, CLASSES)
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
    # Closeness to Keras is not asserted here: on this untrained head (ImageNet features, near-ties everywhere) the
    # mixed build was no closer (64 px: mean |dp| 0.0501 against ptq's 0.0488; 224 px: 0.0338 against 0.0296). On
    # the two real trained runs it is (mean |dp| -20% and -25%, three and two films fewer differing), measured by
    # `covidxray export` (docs/benchmarks.md §6).


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
