"""`covidxray export`: Keras model -> SavedModel -> TFLite (float32, float16, int8) with a parity report.

The SavedModel in `run_dir/saved_model/` is the converter's input and a
deployable artifact in its own right (TF Serving, other converters). Its named
outputs: `probabilities`, `embedding` (the penultimate features, for the
out-of-distribution score) and, where the model ends in global average pooling,
`class_maps` (Grad-CAM without TensorFlow; covidxray/export/class_maps.py). Per format, through the LiteRT interpreter
that will run on the board: the temperature and the out-of-distribution
threshold are fitted on the val split (the OOD means and covariance on train)
and stored in the sidecar, with the chest-layout fit (pixels only, so one fit
serves every format), then parity is measured on the test split, with the
calibrated probabilities predict will show, against the Keras model.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from covidxray.config import Config, ExportConfig
from covidxray.data.tfrecord import read_records
from covidxray.edge import chest_layout, ood, orientation
from covidxray.edge.litert import TFLiteClassifier
from covidxray.edge.model_binding import bind
from covidxray.edge.native_stderr import native_stderr_to
from covidxray.errors import UserError
from covidxray.export import source_profile
from covidxray.export.calibration import calibration_summary
from covidxray.export.class_maps import served_model
from covidxray.export.formats import FORMATS, check_formats
from covidxray.export.input_scaling import fold_input_scaling
from covidxray.export.keras_file import load_keras_model
from covidxray.files import atomic_path, sha256_file, signals_held
from covidxray.manifest import PreparedData, check_model_matches, open_prepared, require_intact_shards
from covidxray.reports import export_report, write_export_report
from covidxray.run_folder import (
    CONVERTER_LOG,
    EXPORT_REPORT,
    MODEL_FILE,
    SAVED_MODEL_DIR,
    ModelCard,
    read_model_card,
    sidecar_path,
    tflite_name,
)
from covidxray.sidecar import SIDECAR_VERSION

SPLITS_READ = ("train", "val", "test")  # train: OOD and layout fits, int8 calibration; val: thresholds; test: parity


def iter_split(data: PreparedData, split: str) -> Iterator[tuple[np.ndarray, int]]:
    for record in read_records(data.shards(split)):
        yield record["image"].astype(np.float32), record["label"]


def load_split(data: PreparedData, split: str) -> tuple[np.ndarray, np.ndarray]:
    images, labels = [], []
    for image, label in iter_split(data, split):
        images.append(image)
        labels.append(label)
    if not images:
        raise UserError(f"{data.path}: the {split} split is empty; export needs it (test: parity with Keras)")
    return np.stack(images), np.array(labels)


def _run_split(
    classifier: TFLiteClassifier, data: PreparedData, split: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The model's own (uncalibrated) probabilities, embeddings and labels over a split, one image at a time."""
    probabilities, embeddings, labels = [], [], []
    for image, label in iter_split(data, split):
        probs, embedding = classifier.infer(image)
        probabilities.append(probs)
        embeddings.append(embedding)
        labels.append(label)
    return np.array(probabilities), np.array(embeddings), np.array(labels, dtype=np.int64)


def fit_calibration_and_ood(classifier: TFLiteClassifier, data: PreparedData, margin: float) -> dict:
    """Sidecar entries `temperature` (fitted on val) and `ood` (train statistics, threshold on val)."""
    val_probs, val_embeddings, val_labels = _run_split(classifier, data, "val")
    if not len(val_labels):
        raise UserError(
            f"{data.path}: the val split is empty; export fits the temperature and the out-of-distribution threshold on it (prepare with data.val_fraction > 0)"
        )
    _, train_embeddings, train_labels = _run_split(classifier, data, "train")
    return {
        "temperature": calibration_summary(val_probs, val_labels, classifier.probability_floor),
        "ood": ood.fit_with_threshold(train_embeddings, train_labels, val_embeddings, len(classifier.labels), margin),
    }


def fit_pixel_checks(data: PreparedData, margin: float) -> dict:
    """Sidecar entries `layout` (covidxray/edge/chest_layout.py: fitted on the train split's model inputs, threshold
    on val) and `orientation` (covidxray/edge/orientation.py: on at most orientation.MAX_FILMS train films, spread
    over the split). Pixels only, so one fit serves every format."""
    train = (image for image, _ in iter_split(data, "train"))  # streamed: the split never sits in memory whole
    val = (image for image, _ in iter_split(data, "val"))
    layout = chest_layout.fit_with_threshold(train, val, margin)
    val = (image for image, _ in iter_split(data, "val"))
    return {
        "layout": layout,
        "orientation": orientation.fit_entry(_spread_over_train(data, orientation.MAX_FILMS), val),
    }


def write_saved_model(model: tf.keras.Model, run_dir: Path) -> Path:
    """Atomic: a half-written SavedModel never sits at the final path."""
    final = run_dir / SAVED_MODEL_DIR
    with atomic_path(final) as tmp:
        tf.saved_model.save(model, str(tmp))
        shutil.rmtree(final, ignore_errors=True)  # a folder replaces only an absent one
    return final


def convert(saved_model: Path, fmt: str, representative: np.ndarray | None = None) -> bytes:
    """The format's flatbuffer with the default export settings."""
    return convert_as_set(saved_model, fmt, representative, ExportConfig(), print)[0]


def convert_as_set(
    saved_model: Path,
    fmt: str,
    representative: np.ndarray | None,
    settings: ExportConfig,
    say: Callable[[str], None],
) -> tuple[bytes, dict]:
    """The format's flatbuffer as `settings` ask for it, and what its report entry says of how it was made."""
    converter = tf.lite.TFLiteConverter.from_saved_model(str(saved_model))
    exporter = FORMATS.get(fmt)
    exporter.configure(converter, representative)
    made = exporter.quantize(converter, settings, say) if exporter.quantize else None
    return made if made is not None else (converter.convert(), {})


def write_model_pair(out: Path, flatbuffer: bytes, sidecar: dict) -> None:
    """The .tflite and its sidecar, so that a reader never uses a model with another export's sidecar.

    Both are written in full to `.partial` names first; then the model replaces the old one, then the
    sidecar, with Ctrl-C and SIGTERM held until both renames are done. A reader that falls between the
    renames sees a pair whose hashes differ, waits a moment and reads it again (covidxray/edge/litert.py);
    after a kill -9 between them the pair stays mismatched, the sidecar's `.partial` beside it, and predict
    refuses it and says to export again.
    """
    with signals_held(), atomic_path(sidecar_path(out)) as card_tmp, atomic_path(out) as model_tmp:
        card_tmp.write_text(json.dumps(sidecar, indent=2))
        model_tmp.write_bytes(flatbuffer)


@dataclass(frozen=True)
class ExportSource:
    """What every format's export starts from: the run's model card, its data set, the Keras model's SavedModel and
    its own answers on the test split (the parity reference)."""

    run_dir: Path
    card: ModelCard
    data: PreparedData
    keras_sha256: str
    served: tf.keras.Model  # the outputs export converts, input scaling folded (the SavedModel's function)
    saved_model: Path
    test_images: np.ndarray
    test_labels: np.ndarray
    keras_pred: np.ndarray
    representative: np.ndarray | None

    @property
    def keras_accuracy(self) -> float:
        return float((self.keras_pred == self.test_labels).mean())


def export(config: Config, say: Callable[[str], None] = print) -> dict:
    """Write saved_model/, model-<fmt>.tflite + sidecar per format, the int8 C array and export_report.json;
    returns the report as written."""
    formats = check_formats(config.export.formats)
    run_dir = Path(config.train.run_dir)
    card, data, same_data = _training_data(config, say)
    source = _convert_source(run_dir, card, data, formats, config.export.representative_samples, say)
    content: dict[str, Any] = {
        "keras": {
            "file": MODEL_FILE,
            "bytes": (run_dir / MODEL_FILE).stat().st_size,
            "accuracy": source.keras_accuracy,
        },
        "saved_model": SAVED_MODEL_DIR,
        "test_images": len(source.test_labels),
        "dataset_id": data.dataset_id,
        "data_is_training_data": same_data,
        "int8_min_agreement": config.export.int8_min_agreement,
    }
    pixel_checks: dict = {}  # pixels only: fitted with the first format, shared by the others
    for fmt in formats:
        flatbuffer, made = _converted(source, fmt, config.export, say)
        content[fmt] = {**export_format(source, fmt, flatbuffer, config.export, pixel_checks, say), **made}
    report = export_report(content)
    write_export_report(run_dir, report)
    below_bar = [fmt for fmt, entry in report.formats.items() if entry.meets_bar is False]  # written and reported first
    if below_bar:
        fmt = below_bar[0]
        raise UserError(
            f"{fmt} model agrees with Keras on only {report.formats[fmt].agreement:.2%} of the test split "
            f"(bar: export.int8_min_agreement={config.export.int8_min_agreement:.2%}); do not deploy "
            f"{run_dir / tflite_name(fmt)}. Try the worst-rounded layers in float (export.int8_method=mixed, for "
            "LiteRT; no C array), more calibration images (export.representative_samples), quantization-aware "
            f"fine-tuning (export.int8_method=qat), or deploy float16; see {run_dir / EXPORT_REPORT}"
        )
    return report.to_json()


def _spread_over_train(data: PreparedData, count: int) -> Iterator[np.ndarray]:
    """At most `count` train films, every n-th over the whole split (streamed): its shards are in class order, so
    the first films would all be one class."""
    step = max(1, -(-data.manifest.splits["train"].records // count))
    return (image for i, (image, _) in enumerate(iter_split(data, "train")) if i % step == 0)


def spread_train_films(data: PreparedData, count: int) -> np.ndarray:
    """At most `count` train films (uint8) spread evenly over the split (int8 calibration, its fine-tune)."""
    films = list(_spread_over_train(data, count))
    if not films:
        raise UserError(f"{data.path}: the train split is empty; export needs it (train: int8 calibration)")
    return np.stack(films).astype(np.uint8)  # gray pixels 0..255: exact, a quarter of float32's memory


def _converted(
    source: ExportSource, fmt: str, settings: ExportConfig, say: Callable[[str], None]
) -> tuple[bytes, dict]:
    """The format's flatbuffer and what its report entry says of how it was made (a fine-tune's seconds,
    the layers a mixed int8 build keeps in float).

    A fine-tuned model (int8 with export.int8_method qat) is converted from a SavedModel of its own, in a
    temporary folder, with the exported one's signature names, so the edge runtime reads it unchanged; the
    run's saved_model/ stays the Keras model's."""
    fine_tune = FORMATS.get(fmt).fine_tune
    started = time.monotonic()
    tuned = (
        fine_tune(source.served, lambda count: spread_train_films(source.data, count), settings, say)
        if fine_tune
        else None
    )
    notes: list[str] = []  # what the conversion says, shown once the terminal is the user's again
    if tuned is None:
        with native_stderr_to(source.run_dir / CONVERTER_LOG):
            flatbuffer, made = convert_as_set(source.saved_model, fmt, source.representative, settings, notes.append)
    else:
        made = {"fine_tune_s": time.monotonic() - started}
        with (
            tempfile.TemporaryDirectory(dir=source.run_dir) as workdir,
            native_stderr_to(source.run_dir / CONVERTER_LOG),
        ):
            saved_model = Path(workdir) / SAVED_MODEL_DIR
            tf.saved_model.save(tuned, str(saved_model), signatures=_named_like(source.served, tuned))
            flatbuffer, quantized = convert_as_set(saved_model, fmt, source.representative, settings, notes.append)
        made.update(quantized)
    for note in notes:
        say(note)
    return flatbuffer, made


def _named_like(served: tf.keras.Model, tuned: tf.keras.Model) -> tf.types.experimental.ConcreteFunction:
    """`tuned`'s serving function with `served`'s input and output names (a wrapped layer's name differs)."""
    spec = tf.TensorSpec(served.inputs[0].shape, tf.float32, name=served.input_names[0])

    @tf.function(input_signature=[spec])
    def serve(image):
        return dict(zip(served.output_names, tuned(image, training=False), strict=True))

    return serve.get_concrete_function()


def _training_data(config: Config, say: Callable[[str], None]) -> tuple[ModelCard, PreparedData, bool]:
    """The model card, the data set export reads (its manifest read once: every step uses it), checked against the
    card, and whether it is the very set the model was trained on."""
    card = read_model_card(Path(config.train.run_dir))
    data = open_prepared(config.data.data_dir)
    same_data = check_model_matches(card, data)
    require_intact_shards(data, SPLITS_READ)
    if not same_data:
        say(
            f"[yellow]warning[/]: {data.path} is not the exact data set the model was trained on (its data set id differs from the model card's); its test split may overlap training images"
        )
    return card, data, same_data


def _convert_source(
    run_dir: Path,
    card: ModelCard,
    data: PreparedData,
    formats: list[str],
    representative_samples: int,
    say: Callable[[str], None],
) -> ExportSource:
    """The Keras model hashed, loaded, run on the test split and written as the SavedModel every format converts."""
    model_path = run_dir / MODEL_FILE
    keras_sha256 = sha256_file(model_path)  # before loading: the sidecar names the very bytes that were converted
    model = load_keras_model(model_path, keras_sha256, "the file just hashed (it changed during export)")
    test_images, test_labels = load_split(data, "test")
    keras_pred = model.predict(test_images, batch_size=64, verbose=0).argmax(1)
    representative = (
        spread_train_films(data, representative_samples)
        if any(FORMATS.get(f).needs_representative for f in formats)
        else None
    )
    log = run_dir / CONVERTER_LOG
    log.unlink(missing_ok=True)
    served = served_model(fold_input_scaling(model))
    with native_stderr_to(log):
        saved_model = write_saved_model(served, run_dir)
    say(f"SavedModel: {saved_model}")
    return ExportSource(
        run_dir, card, data, keras_sha256, served, saved_model, test_images, test_labels, keras_pred, representative
    )


def _fitted_sidecar(
    source: ExportSource, fmt: str, flatbuffer: bytes, settings: ExportConfig, pixel_checks: dict
) -> tuple[dict, TFLiteClassifier]:
    """The format's sidecar with every fit (temperature and OOD on this format's outputs, the pixel checks, the
    source profile) and the model run with it, calibrated, as predict will run it."""
    out = source.run_dir / tflite_name(fmt)
    sidecar = {
        **source.card.sidecar_entries(),
        "version": SIDECAR_VERSION,
        "format": fmt,
        "keras_model": MODEL_FILE,
        "keras_sha256": source.keras_sha256,
    }
    uncalibrated = TFLiteClassifier(out, flatbuffer=flatbuffer, card=sidecar)
    sidecar.update(fit_calibration_and_ood(uncalibrated, source.data, settings.ood_margin))
    if not pixel_checks:  # after the val split was checked (fit_calibration_and_ood)
        pixel_checks.update(fit_pixel_checks(source.data, settings.layout_margin))
    sidecar.update(pixel_checks)
    gated = TFLiteClassifier(out, flatbuffer=flatbuffer, card=sidecar)
    sidecar.update(
        {source_profile.SIDECAR_KEY: source_profile.sidecar_entry(gated, source.data, settings.source_margin)}
    )
    return sidecar, TFLiteClassifier(out, flatbuffer=flatbuffer, card=sidecar)


def _parity(source: ExportSource, classifier: TFLiteClassifier) -> dict:
    """The format's answers on the test split against Keras' and the truth, and how many test images its gates refuse."""
    lite_probs, test_embeddings, _ = _run_split(classifier, source.data, "test")
    lite_pred = classifier.calibrated(lite_probs).argmax(1)
    ood, layout_fit, orientation_fit = classifier.gates()
    temperature, images = classifier.card.temperature, source.test_images
    accuracy = float((lite_pred == source.test_labels).mean())
    return {
        "file": classifier.path.name,
        "agreement": float((lite_pred == source.keras_pred).mean()),
        "accuracy": accuracy,
        "accuracy_delta": accuracy - source.keras_accuracy,
        "temperature": classifier.temperature,
        "val_ece_before_after": [temperature["ece_before"], temperature["ece_after"]],
        "ood_threshold": ood.threshold,
        "test_over_ood_threshold": float((ood.distances(test_embeddings) > ood.threshold).mean()),
        "layout_threshold": layout_fit.threshold,
        "test_over_layout_threshold": float((layout_fit.scores(images) > layout_fit.threshold).mean()),
        "test_not_upright": float(np.mean([orientation_fit.orientation(image)[0] != "upright" for image in images])),
    }


def export_format(
    source: ExportSource,
    fmt: str,
    flatbuffer: bytes,
    settings: ExportConfig,
    pixel_checks: dict,
    say: Callable[[str], None],
) -> dict:
    """One format: fit its sidecar, measure its parity, bind and write the pair, read it back as predict does;
    returns its export report entry."""
    sidecar, classifier = _fitted_sidecar(source, fmt, flatbuffer, settings, pixel_checks)
    entry = _parity(source, classifier)
    parity = {k: entry[k] for k in ("agreement", "accuracy", "accuracy_delta")}
    sidecar.update({"parity": {"test_images": len(source.test_labels), **parity}})
    flatbuffer, sidecar = bind(flatbuffer, sidecar)
    out = classifier.path
    write_model_pair(out, flatbuffer, sidecar)
    TFLiteClassifier(out)  # read back as predict reads it: the pair on disk is whole, bound and usable
    entry["bytes"] = len(flatbuffer)
    extras = FORMATS.get(fmt).extras
    if extras:
        entry.update(extras(out, entry, source.card.labels, source.card.image_size, settings))
    if classifier.card.temperature["at_search_bound"]:
        say(
            f"warning: {fmt}: the temperature stopped at its search limit {entry['temperature']:.3g}: the val split "
            "gives no finite optimum (the model separates it perfectly?), so predict's probabilities are as sharp "
            "as the limit allows; a larger or harder val split (data.val_fraction) gives a fitted value"
        )
    say(
        f"{fmt}: {out} {entry['bytes'] / 1e6:.2f} MB, agreement with Keras {entry['agreement']:.2%}, "
        f"accuracy {entry['accuracy']:.2%} ({entry['accuracy_delta']:+.2%}), temperature {entry['temperature']:.3f} "
        f"(val ECE {entry['val_ece_before_after'][0]:.3f} -> {entry['val_ece_before_after'][1]:.3f}), "
        f"test images beyond the out-of-distribution threshold {entry['test_over_ood_threshold']:.2%}, "
        f"beyond the chest-layout threshold {entry['test_over_layout_threshold']:.2%}, "
        f"not upright {entry['test_not_upright']:.2%}"
    )
    return entry
