"""export.int8_method qat (covidxray/export/qat.py): an int8 build fine-tuned toward the exported model's own answers.

The oracle is TensorFlow Lite's own interpreter on real films: each int8 build's argmax against the Keras model's,
counted here, not by export.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import copy_trained_model, int8_argmax, near_tie_model, run_cli

SIZE, CLASSES = 64, 3


@pytest.mark.slow
def test_qat_int8_agrees_with_keras_at_least_as_well_as_ptq(shared_data, tmp_path):
    import tensorflow as tf

    from covidxray.export.formats import FORMATS
    from covidxray.export.qat import quantization_aware
    from covidxray.export.tflite import _named_like, convert, write_saved_model

    served, train, test, keras = near_tie_model(shared_data, SIZE, CLASSES)
    ptq = convert(write_saved_model(served, tmp_path / "ptq"), "int8", train)

    films = train.astype(np.uint8)
    student = quantization_aware(served, lambda count: films[:count], 12, 3e-6, calibration_films=96, say=print)
    tf.saved_model.save(student, str(tmp_path / "qat"), signatures=_named_like(served, student))
    qat = convert(tmp_path / "qat", "int8", train)

    ptq_agreement = (int8_argmax(ptq, test) == keras).mean()
    qat_agreement = (int8_argmax(qat, test) == keras).mean()
    print(f"int8 agreement with Keras on {len(test)} real films: ptq {ptq_agreement:.2%}, qat {qat_agreement:.2%}")
    assert qat_agreement >= ptq_agreement
    outputs = tf.lite.Interpreter(model_content=qat).get_signature_runner().get_output_details()
    assert set(outputs) == {"probabilities", "embedding", "class_maps"}  # as the edge runtime reads them
    assert FORMATS.get("int8").fine_tune is not None


@pytest.mark.slow
def test_qat_export_writes_the_keras_model_as_float32_and_a_usable_int8(trained_run, synthetic_data, tmp_path):
    from covidxray.edge.litert import TFLiteClassifier

    run_dir = copy_trained_model(trained_run, tmp_path / "run")
    args = ["--run-dir", str(run_dir), "--data-dir", str(synthetic_data), "--format", "float32", "--format", "int8"]
    qat = ["--set", "export.int8_method=qat", "--set", "export.int8_qat_steps=5"]
    # The bar is not this test's concern (5 steps on phantoms): the files, the report and the outputs are.
    result = run_cli("export", *args, *qat, "--set", "export.int8_min_agreement=0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "int8 (qat): step 5/5" in result.stderr  # progress, with the rest of export's, on stderr
    report = json.loads((run_dir / "export_report.json").read_text())
    assert report["int8"]["method"] == "qat" and report["int8"]["fine_tune_s"] > 0
    assert report["float32"]["agreement"] == 1.0  # the float32 file is the Keras model, not the fine-tuned one
    assert "method" not in report["float32"] and "fine_tune_s" not in report["float32"]
    classifier = TFLiteClassifier(run_dir / "model-int8.tflite")
    assert classifier.embedding_output is not None
    probabilities, embedding = classifier.infer(np.full((64, 64, 1), 128, np.float32))
    assert probabilities.shape == (len(classifier.labels),) and embedding is not None
