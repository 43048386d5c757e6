"""Issue 5: `covidxray predict` -- LiteRT only, per-file errors, JSON schema, DICOM input, Grad-CAM."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import run_cli, write_rebound
from test_preprocess import write_dicom

LABELS = ["normal", "pneumonia", "covid-19"]

# The `--json` document (docs/deploy.md): a list with one entry per input file, in input order.
RESULT_SCHEMA = {"file": str, "label": str, "confidence": float, "probabilities": dict}
ERROR_SCHEMA = {"file": str, "error": str, "reason": str}
REJECTED_SCHEMA = {"file": str, "rejected": str, "reason": str, "score": float, "limit": float}
GATE_REASONS = {
    "too-small",
    "too-smooth",
    "extreme-aspect",
    "near-uniform",
    "text-or-noise",
    "few-gray-levels",
    "busy-texture",
    "grainless-blobs",
    "out-of-distribution",
    "not-chest-layout",
    "inverted",
    "upside-down",
    "inverted-upside-down",
}
OPTIONAL = {"gradcam": str, "source_profile": dict}  # source_profile: covidxray/edge/source_profile.py
REASONS = {"missing", "empty", "unreadable", "not-xray", "unsupported", "too-large"}


def one_line(text: str) -> str:
    """CLI errors go through rich, which wraps long lines when stderr is not a terminal."""
    return " ".join(text.split())


def check_schema(document) -> None:
    """Validate a `predict --json` document by hand (no jsonschema dependency)."""
    assert isinstance(document, list)
    for entry in document:
        schema = ERROR_SCHEMA if "error" in entry else REJECTED_SCHEMA if "rejected" in entry else RESULT_SCHEMA
        assert set(schema) <= set(entry) <= set(schema) | set(OPTIONAL), entry
        for key, kind in {**schema, **OPTIONAL}.items():
            assert key not in entry or isinstance(entry[key], kind), (key, entry)
        if "error" in entry:
            assert entry["reason"] in REASONS and entry["error"]
        elif "rejected" in entry:
            assert entry["rejected"] == "not a chest radiograph" and entry["reason"] in GATE_REASONS
        else:
            assert entry["label"] in LABELS and list(entry["probabilities"]) == LABELS
            assert all(isinstance(p, float) and 0 <= p <= 1 for p in entry["probabilities"].values())
            assert entry["confidence"] == max(entry["probabilities"].values())
            assert entry["probabilities"][entry["label"]] == entry["confidence"]


def held_out_images(synthetic_data, count: int) -> list[Path]:
    with open(synthetic_data / "splits.csv", newline="") as handle:
        return [Path(row["image"]) for row in csv.DictReader(handle) if row["split"] == "test"][:count]


@pytest.fixture
def bad_files(tmp_path) -> dict[str, Path]:
    """One file per way an input can be wrong."""
    from pydicom.data import get_testdata_file

    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "notes.txt").write_text("not an image")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    (folder / "empty.jpg").write_bytes(b"")
    photo = np.zeros((80, 80, 3), np.uint8)
    photo[:, :40] = (30, 60, 220)
    photo[:, 40:] = (40, 200, 40)
    cv2.imwrite(str(folder / "photo.jpg"), photo)
    shutil.copy(get_testdata_file("CT_small.dcm", download=False), folder / "ct.dcm")
    (tmp_path / "empty-folder").mkdir()
    return {
        "notes.txt": folder / "notes.txt",
        "broken.png": folder / "broken.png",
        "empty.jpg": folder / "empty.jpg",
        "photo.jpg": folder / "photo.jpg",
        "ct.dcm": folder / "ct.dcm",
        "missing.png": folder / "missing.png",
        "empty-folder": tmp_path / "empty-folder",
    }


EXPECTED_REASONS = {
    "notes.txt": "unreadable",
    "broken.png": "unreadable",
    "empty.jpg": "empty",
    "photo.jpg": "not-xray",
    "ct.dcm": "not-xray",
    "missing.png": "missing",
    "empty-folder": "empty",
}


def test_predict_never_imports_tensorflow(exported_run, synthetic_data):
    wrapper = (
        "import json, sys\n"
        "from covidxray.cli import app\n"
        "try:\n"
        "    app(args=sys.argv[1:], prog_name='covidxray')\n"
        "except SystemExit as done:\n"
        "    code = done.code\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', 'tf_keras'))\n"
        "print('MODULES ' + json.dumps({'exit': code, 'heavy': heavy}), file=sys.stderr)\n"
    )
    images = [str(p) for p in held_out_images(synthetic_data, 2)]
    result = subprocess.run(
        [sys.executable, "-c", wrapper, "predict", "--model", str(exported_run), "--json", *images],
        capture_output=True,
        text=True,
        timeout=300,
    )
    marker = json.loads(result.stderr.rsplit("MODULES ", 1)[1])
    assert marker == {"exit": 0, "heavy": []}, result.stderr[-2000:]
    assert len(json.loads(result.stdout)) == 2


def test_bad_files_get_their_own_error_and_the_rest_still_predict(all_formats_run, synthetic_data, bad_files):
    good = held_out_images(synthetic_data, 3)
    inputs = [good[0], *bad_files.values(), good[1], good[2]]
    result = run_cli("predict", "--model", str(all_formats_run), "--format", "int8", "--json", *map(str, inputs))
    assert result.returncode == 1, result.stderr
    document = json.loads(result.stdout)
    check_schema(document)
    assert [entry["file"] for entry in document] == [str(p) for p in inputs]
    by_file = {Path(entry["file"]).name: entry for entry in document}
    for name, reason in EXPECTED_REASONS.items():
        assert by_file[name]["reason"] == reason, by_file[name]
        assert any(line.startswith(str(bad_files[name])) for line in result.stderr.splitlines()), (name, result.stderr)
    assert all("label" in by_file[p.name] for p in good)
    assert "Traceback" not in result.stderr


def test_plain_output_is_one_line_per_file(exported_run, synthetic_data, bad_files):
    good = held_out_images(synthetic_data, 2)
    result = run_cli(
        "predict",
        "--model",
        str(exported_run / "model-float32.tflite"),
        str(good[0]),
        str(bad_files["photo.jpg"]),
        str(good[1]),
    )
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert [line.split(": ")[0] for line in lines] == [str(good[0]), str(good[1])]
    for line in lines:
        label = line.split(": ", 1)[1].split()[0]
        assert label in LABELS and all(name in line for name in LABELS)
    assert f"{bad_files['photo.jpg']}: colour image" in result.stderr


def test_a_folder_is_expanded_recursively_including_suffixless_dicom(exported_run, synthetic_data, tmp_path):
    folder = tmp_path / "study"
    (folder / "sub").mkdir(parents=True)
    first, second = held_out_images(synthetic_data, 2)
    shutil.copy(first, folder / first.name)
    write_dicom(
        folder / "sub" / "IM0001", cv2.imread(str(second), cv2.IMREAD_GRAYSCALE), WindowCenter=128, WindowWidth=256
    )
    (folder / "README").write_text("a suffix-less file that is not DICOM is skipped")
    result = run_cli("predict", "--model", str(exported_run), "--json", str(folder))
    assert result.returncode == 0, result.stderr
    assert sorted(Path(e["file"]).name for e in json.loads(result.stdout)) == ["IM0001", first.name]


def test_each_format_agrees_with_keras_on_raw_files(all_formats_run, synthetic_data):
    import tensorflow as tf

    from covidxray.edge.predict import predict_files
    from covidxray.edge.preprocess import model_input

    files = held_out_images(synthetic_data, 30)
    keras = tf.keras.models.load_model(str(all_formats_run / "model.keras"), compile=False)
    expected = keras.predict(np.stack([model_input(f, 64) for f in files]), verbose=0).argmax(1)
    for fmt in ("float32", "float16", "int8"):
        results = predict_files(files, all_formats_run / f"model-{fmt}.tflite", threads=2)
        agreement = np.mean([LABELS.index(r["label"]) == e for r, e in zip(results, expected)])
        assert agreement >= 0.95, (fmt, agreement)


def test_dicom_encodings_of_an_image_predict_like_its_png(exported_run, synthetic_data, tmp_path):
    from covidxray.edge.predict import predict_files

    png = held_out_images(synthetic_data, 1)[0]
    gray = cv2.imread(str(png), cv2.IMREAD_GRAYSCALE)
    identity = {"WindowCenter": 128, "WindowWidth": 256}  # DICOM LINEAR window that maps 0..255 onto itself
    files = [
        png,
        write_dicom(tmp_path / "mono2-8bit.dcm", gray, **identity),
        write_dicom(tmp_path / "mono1-8bit.dcm", 255 - gray, photometric="MONOCHROME1", **identity),
        write_dicom(
            tmp_path / "mono2-16bit.dcm",
            gray.astype(np.uint16) * 256,
            RescaleSlope=1 / 256,
            RescaleIntercept=0,
            **identity,
        ),
        write_dicom(
            tmp_path / "cr-12bit-mono1.dcm",
            (255 - gray.astype(np.uint16)) * 16 + 10,
            modality="CR",
            photometric="MONOCHROME1",
            BitsStored=12,
            RescaleSlope=1 / 16,
            RescaleIntercept=-10 / 16,
            **identity,
        ),
    ]
    results = predict_files(files, exported_run / "model-float32.tflite")
    reference = results[0]["probabilities"]
    for result in results[1:]:
        assert result["probabilities"] == reference, result["file"]


def test_model_choice_from_a_run_directory(all_formats_run, synthetic_data):
    image = str(held_out_images(synthetic_data, 1)[0])
    for fmt in ("float16", "int8"):
        result = run_cli("predict", "--model", str(all_formats_run), "--format", fmt, "--json", image)
        assert result.returncode == 0, result.stderr
    result = run_cli("predict", "--model", str(all_formats_run / "model-int8.tflite"), "--format", "int8", image)
    assert result.returncode == 2 and "--format picks a model inside a run directory" in one_line(result.stderr)
    missing = all_formats_run.parent / "no-such-run"  # e.g. a training step that never ran
    result = run_cli("predict", "--model", str(missing), "--format", "int8", image)
    assert result.returncode == 2 and "not found" in one_line(result.stderr), result.stderr


def test_threads_do_not_change_results(all_formats_run, synthetic_data):
    from covidxray.edge.predict import predict_files

    files = held_out_images(synthetic_data, 4)
    one = predict_files(files, all_formats_run / "model-int8.tflite", threads=1)
    assert predict_files(files, all_formats_run / "model-int8.tflite", threads=2) == one


def test_model_without_or_with_a_foreign_sidecar_is_refused(all_formats_run, tmp_path, synthetic_data):
    image = str(held_out_images(synthetic_data, 1)[0])
    shutil.copy(all_formats_run / "model-int8.tflite", tmp_path / "model.tflite")
    result = run_cli("predict", "--model", str(tmp_path / "model.tflite"), image)
    assert result.returncode == 2 and "sidecar" in one_line(result.stderr)
    shutil.copy(all_formats_run / "model-float16.json", tmp_path / "model.json")
    result = run_cli("predict", "--model", str(tmp_path / "model.tflite"), image)
    assert (
        result.returncode == 2
        and "does not match its sidecar" in one_line(result.stderr)
        and "Traceback" not in result.stderr
    )


def test_explain_writes_a_gradcam_overlay_per_image(exported_run, synthetic_data, tmp_path):
    first = held_out_images(synthetic_data, 1)[0]
    twin = tmp_path / "other" / first.name  # same stem from another folder must not overwrite
    twin.parent.mkdir()
    shutil.copy(first, twin)
    out = tmp_path / "heat"
    result = run_cli(
        "predict", "--model", str(exported_run), "--explain", "--explain-dir", str(out), "--json", str(first), str(twin)
    )
    assert result.returncode == 0, result.stderr[-2000:]
    document = json.loads(result.stdout)
    check_schema(document)
    written = [Path(entry["gradcam"]) for entry in document]
    assert [p.name for p in written] == [f"{first.stem}.gradcam.png", f"{first.stem}-2.gradcam.png"]
    original = cv2.imread(str(first), cv2.IMREAD_GRAYSCALE)
    overlay = cv2.imread(str(written[0]), cv2.IMREAD_UNCHANGED)
    assert overlay.shape == (*original.shape, 3)
    assert np.abs(overlay[:, :, 0].astype(int) - overlay[:, :, 2]).max() > 50  # coloured, not the gray X-ray


def evidence_model():
    """Class 0 = 'bright' (mean of a bright-detector channel), class 1 = 'dark' (mean of a dark detector)."""
    import tensorflow as tf

    layers = tf.keras.layers
    inputs = layers.Input((32, 32, 1))
    x = layers.Rescaling(1 / 255)(inputs)
    features = layers.Conv2D(2, 1, activation="relu", name="detectors")
    x = features(x)
    head = layers.Dense(2, activation="softmax")
    outputs = head(layers.GlobalAveragePooling2D()(x))
    model = tf.keras.Model(inputs, outputs)
    features.set_weights([np.array([1.0, -1.0]).reshape(1, 1, 1, 2), np.array([0.0, 1.0])])
    head.set_weights([np.eye(2) * 4, np.zeros(2)])
    return model


def test_gradcam_points_at_the_evidence_for_each_class():
    from covidxray.export.gradcam import heatmap, score_function

    image = np.zeros((32, 32, 1), np.float32)
    image[4:12, 20:28] = 255  # a bright patch, top right
    forward = score_function(evidence_model())
    patch = np.zeros((32, 32), bool)
    patch[4:12, 20:28] = True
    bright, dark = heatmap(forward, image, 0), heatmap(forward, image, 1)
    assert bright.shape == (32, 32) and bright.max() == pytest.approx(1.0)
    assert bright[patch].min() > 0.9 and bright[~patch].max() < 0.1
    assert dark[~patch].min() > 0.9 and dark[patch].max() < 0.1


@pytest.mark.parametrize("name", ["small_cnn", "mobilenet_v3_small"])
def test_gradcam_forward_reproduces_the_model(name):
    """Top-level and nested-backbone graphs: the split pass gives the model's own scores."""
    import tensorflow as tf

    from covidxray.export.gradcam import heatmap, score_function
    from covidxray.train.models import build_model

    model = build_model(name, 64, 3)
    image = np.random.default_rng(0).uniform(0, 255, (64, 64, 1)).astype(np.float32)
    maps, scores = score_function(model)(tf.constant(image[None]))
    np.testing.assert_allclose(
        tf.nn.softmax(scores).numpy(), model(image[None], training=False).numpy(), rtol=1e-4, atol=1e-6
    )
    assert maps.shape.rank == 4
    heat = heatmap(score_function(model), image, 1)
    assert heat.shape == tuple(maps.shape[1:3]) and np.isfinite(heat).all() and 0 <= heat.min() <= heat.max() <= 1


def sidecar_edits() -> dict:
    """name -> (edit of a good sidecar, words the error must contain)."""
    return {
        "a list": (lambda card: [card], "not an object"),
        "no labels": (lambda card: {k: v for k, v in card.items() if k != "labels"}, "lacks labels"),
        "no image_size": (lambda card: {k: v for k, v in card.items() if k != "image_size"}, "lacks image_size"),
        "fewer labels": (lambda card: {**card, "labels": card["labels"][:2]}, "lists 2 labels"),
        "more labels": (lambda card: {**card, "labels": [*card["labels"], "tuberculosis"]}, "lists 4 labels"),
        "other image size": (lambda card: {**card, "image_size": 128}, "image_size 128"),
        "negative temperature": (lambda card: {**card, "temperature": {"value": -1}}, "temperature"),
        "damaged ood": (
            lambda card: {**card, "ood": {**card["ood"], "precision": "AAAA"}},
            "out-of-distribution section is damaged",
        ),
        "damaged layout": (
            lambda card: {**card, "layout": {**card["layout"], "mean": "AAAA"}},
            "chest-layout section is damaged",
        ),
        "layout of another version": (
            lambda card: {**card, "layout": {**card["layout"], "version": card["layout"]["version"] + 1}},
            "chest-layout section is version",
        ),
    }


@pytest.mark.parametrize("name", list(sidecar_edits()))
def test_a_sidecar_that_does_not_fit_the_model_is_one_clear_error(all_formats_run, synthetic_data, tmp_path, name):
    edit, words = sidecar_edits()[name]
    card = json.loads((all_formats_run / "model-int8.json").read_text())
    model = write_rebound(all_formats_run / "model-int8.tflite", tmp_path, edit(card))
    result = run_cli("predict", "--model", str(model), "--json", str(held_out_images(synthetic_data, 1)[0]))
    message = one_line(result.stderr)
    assert result.returncode == 2 and result.stdout == "", (name, message)
    assert f"sidecar {tmp_path / 'model-int8.json'}" in message and words in message and "export" in message, message
    assert "Traceback" not in result.stderr


def test_one_malformed_dicom_among_many_is_a_per_file_error(exported_run, synthetic_data, shared_data, tmp_path):
    """Built from a real CR: a WindowCenter of 'abc', and a VOI LUT sequence whose item lacks its descriptor and data."""
    import pydicom
    from pydicom.dataset import Dataset
    from pydicom.sequence import Sequence

    real = shared_data / "dicom" / "CR-MONO2-8bit-rsna.dcm"
    bad_window = pydicom.dcmread(str(real))
    bad_window.WindowCenter, bad_window.WindowWidth = "-1234.5678", "256"  # pydicom refuses to write "abc" itself
    bad_window.save_as(str(tmp_path / "window-abc.dcm"))
    raw = (tmp_path / "window-abc.dcm").read_bytes()
    assert raw.count(b"-1234.5678") == 1
    (tmp_path / "window-abc.dcm").write_bytes(
        raw.replace(b"-1234.5678", b"abc       ")
    )  # same length: the file stays well-formed
    bad_lut = pydicom.dcmread(str(real))
    item = Dataset()
    item.LUTExplanation = "broken"
    bad_lut.VOILUTSequence = Sequence([item])
    bad_lut.save_as(str(tmp_path / "voi-lut-broken.dcm"))
    good = held_out_images(synthetic_data, 2)
    inputs = [good[0], tmp_path / "window-abc.dcm", real, tmp_path / "voi-lut-broken.dcm", good[1]]
    result = run_cli("predict", "--model", str(exported_run), "--json", *map(str, inputs))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    document = json.loads(result.stdout)
    check_schema(document)
    assert [entry["file"] for entry in document] == [str(p) for p in inputs]
    assert [entry.get("reason") for entry in document[1::2]] == ["unreadable", "unreadable"]
    assert all("label" in entry or "rejected" in entry for entry in document[0::2]), document
    assert "label" in document[0] and "label" in document[4]
    for bad in ("window-abc.dcm", "voi-lut-broken.dcm"):
        assert any(line.startswith(str(tmp_path / bad)) for line in result.stderr.splitlines()), result.stderr


def test_images_with_no_anatomy_are_rejected_not_classified(exported_run, synthetic_data, tmp_path):
    white = tmp_path / "white.png"
    cv2.imwrite(str(white), np.full((600, 600), 255, np.uint8))
    page = tmp_path / "screenshot.png"
    text = np.full((1080, 1920), 255, np.uint8)
    for row in range(1, 26):
        cv2.putText(
            text,
            "Results pending; see the attached radiology report.",
            (40, row * 40),
            cv2.FONT_HERSHEY_SIMPLEX,
            1.0,
            0,
            2,
        )
    cv2.imwrite(str(page), text)
    good = held_out_images(synthetic_data, 1)[0]
    result = run_cli("predict", "--model", str(exported_run), "--json", str(white), str(good), str(page))
    assert result.returncode == 1, result.stderr
    document = json.loads(result.stdout)
    check_schema(document)
    assert [entry.get("reason") for entry in document] == ["near-uniform", None, "text-or-noise"]
    assert document[0]["score"] == 0.0 and document[0]["limit"] == 24.0 and "label" in document[1]
    plain = run_cli("predict", "--model", str(exported_run), str(white), str(good))
    assert (
        plain.stdout.splitlines()[0] == f"{white}: rejected: not a chest radiograph (near-uniform, score 0, limit 24)"
    )


def test_an_image_the_model_never_saw_the_like_of_is_rejected_by_its_embedding(exported_run, synthetic_data, tmp_path):
    """Smooth blobs with a film-like grain pass every cheap check (wide gray range, detail at 3 and 9 px
    like a film's) but are nothing like the training data. Without the grain, `grainless-blobs` refuses them."""
    from covidxray.edge import radiograph_gate
    from covidxray.edge.predict import predict_files

    rng = np.random.default_rng(0)
    smooth = cv2.normalize(cv2.GaussianBlur(rng.normal(0, 1, (256, 256)), (0, 0), 4), None, 0, 255, cv2.NORM_MINMAX)
    blobs = np.clip(smooth + rng.normal(0, 4, smooth.shape), 0, 255).astype(np.uint8)
    assert radiograph_gate.check(blobs).passed
    cv2.imwrite(str(tmp_path / "blobs.png"), blobs)
    good = held_out_images(synthetic_data, 20)
    from covidxray.edge.litert import TFLiteClassifier
    from covidxray.edge.preprocess import as_model_input

    results = predict_files([tmp_path / "blobs.png", *good], exported_run / "model-float32.tflite")
    assert "rejected" in results[0] and results[0]["score"] > results[0]["limit"], results[0]
    assert all("label" in r for r in results[1:]), [r for r in results[1:] if "label" not in r]
    # the orientation check may refuse the blobs first (no orientation of a film fits them); the embedding does too
    classifier = TFLiteClassifier(exported_run / "model-float32.tflite")
    embedding = classifier.infer(as_model_input(blobs, classifier.image_size))[1]
    assert classifier.ood_distance(embedding) > classifier.ood.threshold


def test_the_layout_check_answers_with_its_score(exported_run, synthetic_data, tmp_path):
    """Two sidecars for one model: as exported; its layout threshold set near 0 (every image beyond it).
    A sidecar without the layout entry is an error (tests/test_security_edge.py), not a check switched off."""
    from covidxray.edge.predict import predict_files

    model = exported_run / "model-float32.tflite"
    card = json.loads((exported_run / "model-float32.json").read_text())
    images = held_out_images(synthetic_data, 6)

    def predict_with(name: str, sidecar: dict) -> list[dict]:
        results = predict_files(images, write_rebound(model, tmp_path / name, sidecar))
        check_schema(results)
        return results

    assert all("label" in r for r in predict_with("exported", card))
    strict = predict_with("strict", {**card, "layout": {**card["layout"], "threshold": 1e-9}})
    assert all(r["reason"] == "not-chest-layout" and r["score"] > r["limit"] == 1e-9 for r in strict), strict


@pytest.mark.parametrize("trained", ["other version", "described, before versions"])
def test_a_model_trained_with_other_preprocessing_still_predicts_with_a_warning(
    exported_run, synthetic_data, tmp_path, trained
):
    from covidxray.edge.preprocess import PREPROCESSING_VERSION

    card = json.loads((exported_run / "model-float32.json").read_text())
    assert card["preprocessing"] == PREPROCESSING_VERSION
    image = str(held_out_images(synthetic_data, 1)[0])
    assert "warning" not in run_cli("predict", "--model", str(exported_run / "model-float32.tflite"), image).stderr
    card["preprocessing"] = (
        PREPROCESSING_VERSION + 1 if trained == "other version" else {"decode": "grayscale", "resize": "cv2.INTER_AREA"}
    )
    write_rebound(exported_run / "model-float32.tflite", tmp_path, card)
    result = run_cli("predict", "--model", str(tmp_path / "model-float32.tflite"), "--json", image)
    message = one_line(result.stderr)
    assert result.returncode == 0 and json.loads(result.stdout)[0]["label"] in LABELS, message
    old = f"version {PREPROCESSING_VERSION + 1}" if trained == "other version" else "older than version 1"
    assert f"warning: {tmp_path / 'model-float32.tflite'} was trained on images made by preprocessing {old}" in message
    assert f"this predictor does version {PREPROCESSING_VERSION}" in message
