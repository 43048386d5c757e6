"""`covidxray export`: Keras model -> SavedModel -> TFLite (float32, float16, int8) with a parity report.

The SavedModel in `run_dir/saved_model/` is the converter's input and a
deployable artifact in its own right (TF Serving, other converters). Parity is
measured on the test split with the LiteRT interpreter that will run on the
board, against the Keras model that produced it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import tensorflow as tf

from covidxray.config import Config
from covidxray.data.prepare import load_manifest, manifest_sha256, shard_paths
from covidxray.data.tfrecord import read_records
from covidxray.errors import UserError
from covidxray.export.c_array import write_c_array
from covidxray.export.litert import TFLiteClassifier, sidecar_path, tflite_name
from covidxray.export.native_stderr import native_stderr_to
from covidxray.train.trainer import MODEL_CARD, MODEL_FILE, write_json

FORMATS = ("float32", "float16", "int8")
SAVED_MODEL_DIR = "saved_model"
REPORT_FILE = "export_report.json"
CONVERTER_LOG = "export_converter.log"


def load_split(data_dir: Path, split: str, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    images, labels = [], []
    for i, record in enumerate(read_records(shard_paths(data_dir, split))):
        if limit is not None and i >= limit:
            break
        images.append(record["image"].astype(np.float32))
        labels.append(record["label"])
    if not images:
        raise UserError(f"{data_dir}: the {split} split is empty; export needs it (test for parity, train for int8 calibration)")
    return np.stack(images), np.array(labels)


def check_formats(formats: list[str]) -> list[str]:
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise UserError(f"export formats {formats}: choose one or more of {', '.join(FORMATS)}")
    return list(dict.fromkeys(formats))  # keep order, drop repeats


def write_saved_model(model: tf.keras.Model, run_dir: Path) -> Path:
    """Atomic: a half-written SavedModel never sits at the final path."""
    final, tmp = run_dir / SAVED_MODEL_DIR, run_dir / f".{SAVED_MODEL_DIR}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tf.saved_model.save(model, str(tmp))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def convert(saved_model: Path, fmt: str, representative: np.ndarray | None = None) -> bytes:
    converter = tf.lite.TFLiteConverter.from_saved_model(str(saved_model))
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
    return converter.convert()


def _write_atomic(path: Path, payload: bytes) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_bytes(payload)
    os.replace(tmp, path)


def _check_data_matches(card: dict, data_dir: Path, say: Callable[[str], None]) -> str:
    manifest = load_manifest(data_dir)
    if manifest["labels"] != card["labels"] or int(manifest["image_size"]) != int(card["image_size"]):
        raise UserError(
            f"{data_dir} holds {manifest['labels']} at {manifest['image_size']} px but the model was trained on "
            f"{card['labels']} at {card['image_size']} px: point --data-dir at the data it was trained on"
        )
    digest = manifest_sha256(data_dir)
    if digest != card.get("manifest_sha256"):
        say(f"[yellow]warning[/]: {data_dir} is not the exact data set the model was trained on (manifest hash differs); its test split may overlap training images")
    return digest


def export(config: Config, say: Callable[[str], None] = print) -> dict:
    """Write saved_model/, model-<fmt>.tflite + sidecar per format, the int8 C array and export_report.json."""
    formats = check_formats(config.export.formats)
    run_dir, data_dir = Path(config.train.run_dir), Path(config.data.data_dir)
    model_path, card_path = run_dir / MODEL_FILE, run_dir / MODEL_CARD
    if not model_path.is_file() or not card_path.is_file():
        raise UserError(f"no trained model in {run_dir} ({MODEL_FILE}, {MODEL_CARD}): run `covidxray train` first")
    card = json.loads(card_path.read_text())
    data_digest = _check_data_matches(card, data_dir, say)
    model = tf.keras.models.load_model(str(model_path), compile=False)
    test_images, test_labels = load_split(data_dir, "test")
    keras_pred = model.predict(test_images, batch_size=64, verbose=0).argmax(1)
    representative = load_split(data_dir, "train", config.export.representative_samples)[0] if "int8" in formats else None
    log = run_dir / CONVERTER_LOG
    log.unlink(missing_ok=True)
    with native_stderr_to(log):
        saved_model = write_saved_model(model, run_dir)
    say(f"SavedModel: {saved_model}")

    report = {
        "keras": {"file": MODEL_FILE, "bytes": model_path.stat().st_size, "accuracy": float((keras_pred == test_labels).mean())},
        "saved_model": SAVED_MODEL_DIR,
        "test_images": len(test_labels),
        "data_manifest_sha256": data_digest,
        "training_manifest_sha256": card.get("manifest_sha256"),
        "int8_min_agreement": config.export.int8_min_agreement,
    }
    for fmt in formats:
        with native_stderr_to(log):
            flatbuffer = convert(saved_model, fmt, representative)
        out = run_dir / tflite_name(fmt)
        _write_atomic(out, flatbuffer)
        sidecar = {**card, "format": fmt, "tflite_sha256": hashlib.sha256(flatbuffer).hexdigest(), "keras_model": MODEL_FILE}
        lite_pred = TFLiteClassifier(out, card=sidecar).predict(test_images).argmax(1)
        entry = {
            "file": out.name,
            "bytes": len(flatbuffer),
            "agreement": float((lite_pred == keras_pred).mean()),
            "accuracy": float((lite_pred == test_labels).mean()),
        }
        entry["accuracy_delta"] = entry["accuracy"] - report["keras"]["accuracy"]
        sidecar["parity"] = {"test_images": len(test_labels), **{k: entry[k] for k in ("agreement", "accuracy", "accuracy_delta")}}
        write_json(sidecar_path(out), sidecar)
        if fmt == "int8":
            entry["meets_bar"] = entry["agreement"] >= config.export.int8_min_agreement
            entry["c_array"] = [p.name for p in write_c_array(out, card["labels"], int(card["image_size"]))]
        report[fmt] = entry
        say(
            f"{fmt}: {out} {entry['bytes'] / 1e6:.2f} MB, agreement with Keras {entry['agreement']:.2%}, "
            f"accuracy {entry['accuracy']:.2%} ({entry['accuracy_delta']:+.2%})"
        )
    write_json(run_dir / REPORT_FILE, report)
    if not report.get("int8", {}).get("meets_bar", True):
        raise UserError(
            f"int8 model agrees with Keras on only {report['int8']['agreement']:.2%} of the test split "
            f"(bar: export.int8_min_agreement={config.export.int8_min_agreement:.2%}); do not deploy "
            f"{run_dir / tflite_name('int8')}. Try more calibration images (export.representative_samples) "
            f"or deploy float16; see {run_dir / REPORT_FILE}"
        )
    return report
