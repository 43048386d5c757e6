"""`covidxray export`: Keras model -> TFLite (float32, float16, int8) with a parity report.

Parity is measured on the test split with the LiteRT interpreter that will
run on the board, against the Keras model that produced it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
import tensorflow as tf

from covidxray.config import Config
from covidxray.data.prepare import shard_paths
from covidxray.data.tfrecord import read_records
from covidxray.errors import UserError
from covidxray.export.litert import TFLiteClassifier, sidecar_path
from covidxray.train.trainer import MODEL_CARD, MODEL_FILE

FORMATS = ("float32", "float16", "int8")


def load_split(data_dir: Path, split: str, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    images, labels = [], []
    for i, record in enumerate(read_records(shard_paths(data_dir, split))):
        if limit is not None and i >= limit:
            break
        images.append(record["image"].astype(np.float32))
        labels.append(record["label"])
    return np.stack(images), np.array(labels)


def convert(model: tf.keras.Model, fmt: str, representative: np.ndarray | None = None) -> bytes:
    converter = tf.lite.TFLiteConverter.from_keras_model(model)
    if fmt == "float16":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.target_spec.supported_types = [tf.float16]
    elif fmt == "int8":
        def samples():
            for image in representative:
                yield [image[None].astype(np.float32)]

        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.representative_dataset = samples
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        converter.inference_input_type = tf.uint8  # gray pixels 0..255 are exactly uint8
        converter.inference_output_type = tf.uint8
    elif fmt != "float32":
        raise UserError(f"unknown export format {fmt!r}; choose from {', '.join(FORMATS)}")
    return converter.convert()


def export(config: Config, say: Callable[[str], None] = print) -> dict:
    run_dir, data_dir = Path(config.train.run_dir), Path(config.data.data_dir)
    model_path, card_path = run_dir / MODEL_FILE, run_dir / MODEL_CARD
    if not model_path.is_file() or not card_path.is_file():
        raise UserError(f"no trained model in {run_dir} ({MODEL_FILE}, {MODEL_CARD}): run `covidxray train` first")
    card = json.loads(card_path.read_text())
    model = tf.keras.models.load_model(str(model_path), compile=False)
    test_images, test_labels = load_split(data_dir, "test")
    keras_probs = model.predict(test_images, batch_size=64, verbose=0)
    keras_pred = keras_probs.argmax(1)
    representative = None
    if "int8" in config.export.formats:
        representative, _ = load_split(data_dir, "train", config.export.representative_samples)

    report = {"keras": {"file": MODEL_FILE, "bytes": model_path.stat().st_size, "accuracy": float((keras_pred == test_labels).mean())}, "test_images": len(test_labels)}
    for fmt in config.export.formats:
        flatbuffer = convert(model, fmt, representative)
        out = run_dir / f"model-{fmt}.tflite"
        tmp = out.with_suffix(".partial")
        tmp.write_bytes(flatbuffer)
        os.replace(tmp, out)
        sidecar = {**card, "format": fmt, "tflite_sha256": hashlib.sha256(flatbuffer).hexdigest()}
        sidecar_path(out).write_text(json.dumps(sidecar, indent=2))
        lite_pred = TFLiteClassifier(out).predict(test_images).argmax(1)
        entry = {
            "file": out.name,
            "bytes": len(flatbuffer),
            "agreement": float((lite_pred == keras_pred).mean()),
            "accuracy": float((lite_pred == test_labels).mean()),
        }
        entry["accuracy_delta"] = entry["accuracy"] - report["keras"]["accuracy"]
        report[fmt] = entry
        say(f"{fmt}: {out} {entry['bytes'] / 1e6:.2f} MB, agreement with Keras {entry['agreement']:.2%}, accuracy {entry['accuracy']:.2%}")
    (run_dir / "export_report.json").write_text(json.dumps(report, indent=2))
    low = report.get("int8", {}).get("agreement", 1.0)
    if low < config.export.int8_min_agreement:
        raise UserError(
            f"int8 model agrees with Keras on only {low:.2%} of the test split "
            f"(bar: export.int8_min_agreement={config.export.int8_min_agreement:.2%}); see {run_dir / 'export_report.json'}"
        )
    return report
