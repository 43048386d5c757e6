"""Issue 25, edge / export / evaluate half: each case of the round-3 reliability report
(../shared/reviews/reliability-round3-2026-12-05.md), rebuilt from its reproduction, ends as OK or a clear error."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
from conftest import copy_trained_model, covidxray_cmd, run_cli, with_default_sigint
from test_predict import check_schema, held_out_images, one_line

from covidxray.edge.model_binding import bind


def copy_export(run_dir: Path, target: Path, fmt: str = "float32") -> Path:
    """The .tflite and sidecar of one format, as copied to a board."""
    target.mkdir(parents=True, exist_ok=True)
    for suffix in (".tflite", ".json"):
        shutil.copy(run_dir / f"model-{fmt}{suffix}", target / f"model-{fmt}{suffix}")
    return target / f"model-{fmt}.tflite"


def edit_sidecar(model: Path, edit, rebind: bool = False) -> None:
    """Edit a sidecar by hand, or (`rebind`) as someone who also rewrites the model's digest to match."""
    card_path = model.with_suffix(".json")
    card = edit(json.loads(card_path.read_text()))
    if rebind:
        flatbuffer, card = bind(model.read_bytes(), card)
        model.write_bytes(flatbuffer)
    card_path.write_text(json.dumps(card))


def assert_clear_error(result: subprocess.CompletedProcess, *words: str) -> str:
    message = one_line(result.stderr)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    for word in words:
        assert word in message, (word, message)
    return message


# --- S3, S3b, S4: no code from a Keras file, and Grad-CAM only from the model the .tflite came from -------


def evil_hdf5(path: Path, marker: Path, size: int = 64) -> Path:
    """A legacy HDF5 Keras model whose Lambda layer creates `marker` when the model is rebuilt (on load)."""
    import tensorflow as tf

    inputs = tf.keras.Input((size, size, 1))
    touched = tf.keras.layers.Lambda(lambda t, p=str(marker): (open(p, "w").close(), t)[1])(inputs)
    features = tf.keras.layers.Conv2D(2, 3, name="features")(touched)
    pooled = tf.keras.layers.GlobalAveragePooling2D()(features)
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(3, activation="softmax", name="probabilities")(pooled))
    model.save(str(path.with_suffix(".h5")), save_format="h5")
    marker.unlink(missing_ok=True)  # building it ran the Lambda once
    path.with_suffix(".h5").rename(path)
    return path


def test_the_evil_hdf5_model_really_runs_its_code_when_keras_loads_it(tmp_path):
    """The oracle for the tests below: Keras' own loader runs the Lambda (which is what they must prevent)."""
    import tensorflow as tf

    marker = tmp_path / "PWNED"
    evil = evil_hdf5(tmp_path / "evil.h5", marker)
    assert not marker.exists()
    tf.keras.models.load_model(str(evil), compile=False)
    assert marker.exists()


def test_s3b_export_refuses_an_hdf5_model_keras_without_running_it(trained_run, synthetic_data, tmp_path):
    run_dir = copy_trained_model(trained_run, tmp_path / "run")
    marker = tmp_path / "PWNED_H5"
    evil_hdf5(run_dir / "model.keras", marker)
    result = run_cli("export", "--run-dir", str(run_dir), "--data-dir", str(synthetic_data), "--format", "float32")
    assert_clear_error(result, "legacy HDF5", "refusing to load it")
    assert not marker.exists()
    assert not (run_dir / "model-float32.tflite").exists()


def test_s3_predict_explain_never_loads_the_file_a_sidecar_names(exported_run, synthetic_data, tmp_path):
    """The sidecar's keras_model set to ../evil.h5 (the sidecar re-bound to the model, as an attacker rewriting
    both would), then the same evil file put where the Keras model belongs, with its hash forged too."""
    marker = tmp_path / "PWNED_H5"
    evil = evil_hdf5(tmp_path / "evil.h5", marker)
    model = copy_export(exported_run, tmp_path / "m")
    image = str(held_out_images(synthetic_data, 1)[0])
    explain = ["predict", "--model", str(model), "--explain", "--explain-dir", str(tmp_path / "gc"), image]

    edit_sidecar(model, lambda card: {**card, "keras_model": "../evil.h5"}, rebind=True)
    assert_clear_error(run_cli(*explain), "--explain needs the Keras model", "not found")

    from covidxray.files import sha256_file

    shutil.copy(evil, model.parent / "model.keras")
    assert_clear_error(run_cli(*explain), "is not the model model-float32.tflite was converted from")
    edit_sidecar(model, lambda card: {**card, "keras_sha256": sha256_file(evil)}, rebind=True)
    assert_clear_error(run_cli(*explain), "legacy HDF5")
    assert_clear_error(run_cli(*explain[:-1], "--keras-model", str(evil), image), "legacy HDF5")
    assert not marker.exists() and not (tmp_path / "gc").exists()


def test_s4_gradcam_refuses_a_model_retrained_after_export_or_another_model(exported_run, synthetic_data, tmp_path):
    import tensorflow as tf

    from covidxray.train.models import build_model

    run_dir = tmp_path / "run"
    copy_export(exported_run, run_dir)
    shutil.copy(exported_run / "model.keras", run_dir / "model.keras")
    image = str(held_out_images(synthetic_data, 1)[0])
    explain = ["predict", "--model", str(run_dir), "--explain", "--explain-dir", str(tmp_path / "gc"), "--json", image]
    result = run_cli(*explain)
    assert result.returncode == 0, result.stderr[-2000:]
    assert Path(json.loads(result.stdout)[0]["gradcam"]).is_file()

    tf.keras.utils.set_random_seed(7)  # "train again with another seed": same architecture, other weights
    build_model("small_cnn", 64, 3).save(str(tmp_path / "other.keras"))
    assert_clear_error(
        run_cli(*explain[:-2], "--keras-model", str(tmp_path / "other.keras"), image),
        "is not the model model-float32.tflite was converted from",
    )
    shutil.copy(tmp_path / "other.keras", run_dir / "model.keras")
    assert_clear_error(run_cli(*explain), "retrained or replaced since that export", "export again")


def keras_zip_with(tmp_path: Path, name: str, edit) -> Path:
    """A real small_cnn .keras file whose config.json was edited by `edit(config)`."""
    import zipfile

    from covidxray.train.models import build_model

    good = tmp_path / "good.keras"
    if not good.exists():
        build_model("small_cnn", 32, 3).save(str(good))
    path = tmp_path / name
    with zipfile.ZipFile(good) as source, zipfile.ZipFile(path, "w") as target:
        for item in source.infolist():
            data = source.read(item)
            if item.filename == "config.json":
                data = json.dumps(edit(json.loads(data))).encode()
            target.writestr(item, data)
    return path


def first_layer(config: dict) -> dict:
    return next(layer for layer in config["config"]["layers"] if layer["class_name"] == "Conv2D")


def test_keras_files_are_checked_before_keras_sees_them(tmp_path):
    import tensorflow as tf

    from covidxray.errors import UserError
    from covidxray.export.keras_file import check_keras_file, load_keras_model

    def foreign_module(config):
        first_layer(config)["module"] = "os"
        return config

    def python_lambda(config):
        layer = first_layer(config)
        layer["class_name"], layer["module"] = "Lambda", "keras.layers"
        return config

    def tf_call(config):
        layer = first_layer(config)
        layer["class_name"], layer["module"] = "TFOpLambda", "keras.src.layers.core.tf_op_layer"
        layer["config"]["function"] = "io.write_file"
        return config

    cases = {
        "foreign.keras": (foreign_module, "from module os"),
        "lambda.keras": (python_lambda, "a Lambda layer"),
        "tfcall.keras": (tf_call, "tf.io.write_file"),
    }
    for name, (edit, words) in cases.items():
        with pytest.raises(UserError, match=words):
            check_keras_file(keras_zip_with(tmp_path, name, edit))
    (tmp_path / "not-a-model.keras").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(UserError, match="is not a .keras model file"):
        check_keras_file(tmp_path / "not-a-model.keras")
    model = load_keras_model(tmp_path / "good.keras")  # the untouched file loads
    assert isinstance(model, tf.keras.Model) and model.output_shape == (None, 3)


# --- N9, N10b, N10c, 5.6: the sidecar bound to its model -----------------------------------------------------


@pytest.mark.parametrize(
    "name,edit",
    [
        ("permuted labels", lambda card: {**card, "labels": [card["labels"][i] for i in (2, 0, 1)]}),
        ("renamed label", lambda card: {**card, "labels": [*card["labels"][:2], "tuberculosis"]}),
        ("huge ood threshold", lambda card: {**card, "ood": {**card["ood"], "threshold": 1e30}}),
        ("other temperature", lambda card: {**card, "temperature": {**card["temperature"], "value": 20.0}}),
    ],
)
def test_n10b_an_edited_sidecar_is_refused(exported_run, synthetic_data, tmp_path, name, edit):
    model = copy_export(exported_run, tmp_path / "m")
    edit_sidecar(model, edit)
    result = run_cli("predict", "--model", str(model), "--json", str(held_out_images(synthetic_data, 1)[0]))
    assert_clear_error(result, "was changed after `covidxray export` wrote it", "model-float32.tflite")
    assert result.stdout == ""


@pytest.mark.parametrize(
    "name,edit,words",
    [
        (
            "ood threshold NaN",
            lambda card: {**card, "ood": {**card["ood"], "threshold": float("nan")}},
            "threshold nan",
        ),
        (
            "layout threshold inf",
            lambda card: {**card, "layout": {**card["layout"], "threshold": float("inf")}},
            "threshold inf",
        ),
        ("layout threshold 0", lambda card: {**card, "layout": {**card["layout"], "threshold": 0}}, "threshold 0"),
        ("no ood, no layout", lambda card: {k: v for k, v in card.items() if k not in ("ood", "layout")}, "lacks ood"),
        ("no temperature", lambda card: {k: v for k, v in card.items() if k != "temperature"}, "lacks temperature"),
    ],
)
def test_n10c_a_gate_threshold_that_is_not_a_number_is_an_error_even_when_rebound(
    exported_run, synthetic_data, tmp_path, name, edit, words
):
    """Edited and re-bound (as a broken exporter would write it): the gate must not silently switch off."""
    model = copy_export(exported_run, tmp_path / "m")
    edit_sidecar(model, edit, rebind=True)
    result = run_cli("predict", "--model", str(model), str(held_out_images(synthetic_data, 1)[0]))
    assert_clear_error(result, f"sidecar {model.with_suffix('.json')}", words)
    assert result.stdout == ""


@pytest.mark.parametrize("damage", ["truncated", "png"])
def test_5_6_a_damaged_model_whose_sidecar_lacks_its_hash_is_a_clear_error(
    exported_run, synthetic_data, tmp_path, damage
):
    model = copy_export(exported_run, tmp_path / "m")
    if damage == "truncated":
        model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    else:
        cv2.imwrite(str(tmp_path / "x.png"), np.zeros((32, 32), np.uint8))
        model.write_bytes((tmp_path / "x.png").read_bytes())
    edit_sidecar(model, lambda card: {k: v for k, v in card.items() if k != "tflite_sha256"})
    result = run_cli("predict", "--model", str(model), str(held_out_images(synthetic_data, 1)[0]))
    assert_clear_error(result, str(model), "is not a usable TFLite model")


def test_an_export_without_a_digest_in_the_model_is_refused(exported_run, synthetic_data, tmp_path):
    """An older export (no digest in the .tflite): its sidecar could have been edited, so it is not trusted."""
    from covidxray.edge.model_binding import METADATA_NAME

    model = copy_export(exported_run, tmp_path / "m")
    flatbuffer = model.read_bytes()
    assert flatbuffer.count(METADATA_NAME.encode()) == 1
    model.write_bytes(flatbuffer.replace(METADATA_NAME.encode(), b"x" * len(METADATA_NAME)))
    import hashlib

    edit_sidecar(model, lambda card: {**card, "tflite_sha256": hashlib.sha256(model.read_bytes()).hexdigest()})
    result = run_cli("predict", "--model", str(model), str(held_out_images(synthetic_data, 1)[0]))
    assert_clear_error(result, "carries no digest of its sidecar", "export again")


WRITER = """
import json, os, sys
from pathlib import Path
from covidxray.edge.model_binding import bind
from covidxray.export.tflite import write_model_pair
out = Path(sys.argv[1])
card = json.loads(Path(sys.argv[2]).read_text())
flatbuffer, card = bind(out.read_bytes(), {**card, "parity": {"new export": True}})
renames = []
real_replace = os.replace
def replace(source, target):
    real_replace(source, target)
    renames.append(Path(target).name)
    print(json.dumps(renames), flush=True)
    if len(renames) == 1:
        os._exit(9)  # kill -9 between the two renames
os.replace = replace
write_model_pair(out, flatbuffer, card)
"""


def test_n9_an_export_killed_between_its_two_renames_leaves_a_pair_predict_refuses(
    exported_run, synthetic_data, tmp_path
):
    model = copy_export(exported_run, tmp_path / "m")
    old_card = model.with_suffix(".json").read_text()
    killed = subprocess.run(
        [sys.executable, "-c", WRITER, str(model), str(model.with_suffix(".json"))], capture_output=True, text=True
    )
    assert killed.returncode == 9 and json.loads(killed.stdout) == ["model-float32.tflite"], killed.stderr
    assert model.with_suffix(".json").read_text() == old_card  # the new model beside the old sidecar
    assert (tmp_path / "m" / "model-float32.json.partial").exists()
    result = run_cli("predict", "--model", str(model), str(held_out_images(synthetic_data, 1)[0]))
    assert_clear_error(
        result, "does not match its sidecar", "an export was interrupted", "run `covidxray export` again"
    )
    assert result.stdout == ""


def test_n9_a_reader_between_the_two_renames_reads_the_pair_again(exported_run, tmp_path, monkeypatch):
    """predict starting while an export switches the pair: the first read mismatches, the second matches."""
    from covidxray.edge import litert

    model = copy_export(exported_run, tmp_path / "m")
    card = json.loads(model.with_suffix(".json").read_text())
    flatbuffer, new_card = bind(model.read_bytes(), {**card, "parity": {"new export": True}})
    model.write_bytes(flatbuffer)  # the first rename has happened
    sleeps = []

    def second_rename(seconds):
        sleeps.append(seconds)
        model.with_suffix(".json").write_text(json.dumps(new_card))

    monkeypatch.setattr(litert.time, "sleep", second_rename)
    classifier = litert.TFLiteClassifier(model)
    assert sleeps == [litert.PAIR_RETRY_S] and classifier.card.parity == {"new export": True}


def test_a_normal_export_writes_a_bound_pair_and_no_leftovers(exported_run):
    from covidxray.edge.model_binding import binding_problem, embedded_digest, sidecar_digest
    from covidxray.files import sha256_file

    model = exported_run / "model-float32.tflite"
    card = json.loads(model.with_suffix(".json").read_text())
    assert binding_problem(model.read_bytes(), card) is None
    assert embedded_digest(model.read_bytes()) == sidecar_digest(card)
    assert card["keras_sha256"] == sha256_file(exported_run / "model.keras")
    assert not list(exported_run.glob("*.partial"))


# --- N20a, N20b: export and evaluate read only shards the manifest vouches for ------------------------------


def tamper(data_dir: Path, split: str, how: str) -> str:
    """Damage the first shard of `split`: flip one byte, or rewrite it with every label changed (valid CRCs)."""
    import tensorflow as tf

    from covidxray.data.tfrecord import write_shard

    shard = sorted((data_dir / "shards").glob(f"{split}-*.tfrecord"))[0]
    if how == "bit flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x55
        shard.write_bytes(bytes(data))
        return shard.name
    examples = []
    for raw in tf.data.TFRecordDataset(str(shard)):
        example = tf.train.Example.FromString(raw.numpy())
        label = example.features.feature["label"].int64_list.value
        label[0] = (label[0] + 1) % 3
        examples.append(example.SerializeToString())
    write_shard(shard, examples)
    return shard.name


@pytest.mark.parametrize("split,how", [("test", "bit flip"), ("val", "relabelled"), ("test", "relabelled")])
@pytest.mark.parametrize("command", ["export", "evaluate"])
def test_n20_export_and_evaluate_refuse_damaged_or_relabelled_shards(
    trained_run, synthetic_data, tmp_path, command, split, how
):
    data_dir = tmp_path / "data"
    shutil.copytree(synthetic_data, data_dir)
    name = tamper(data_dir, split, how)
    run_dir = copy_trained_model(trained_run, tmp_path / "run")
    result = run_cli(command, "--run-dir", str(run_dir), "--data-dir", str(data_dir))
    assert_clear_error(result, "damaged (sha256 differs from manifest.json)", name, "covidxray prepare")
    assert not (run_dir / "model-float32.tflite").exists() and not (run_dir / "evaluation.json").exists()


# --- N14b, N15: the pixel limit holds wherever the size sits, and can be raised for a real large film -----------


def jpeg_with_sof_after(gray: np.ndarray, padding: int, width: int, height: int) -> bytes:
    """A real JPEG of `gray`, with `padding` bytes of APP1 segments before its frame header and that header's
    size replaced by width x height."""
    ok, encoded = cv2.imencode(".jpg", gray)
    data = encoded.tobytes()
    segments = b""
    while len(segments) < padding:
        segments += b"\xff\xe1" + struct.pack(">H", 65535) + bytes(65533)
    data = data[:2] + segments + data[2:]
    sof = data.index(b"\xff\xc0")
    return data[: sof + 5] + struct.pack(">HH", height, width) + data[sof + 9 :]


def test_n14b_a_jpeg_size_is_found_after_128_kib_of_segments(tmp_path):
    from covidxray.edge.image_header import declared_size

    path = tmp_path / "deep.jpg"
    path.write_bytes(jpeg_with_sof_after(np.zeros((64, 64), np.uint8), 128 << 10, 30000, 30000))
    assert path.stat().st_size > 128 << 10
    assert declared_size(path) == (30000, 30000)


MAX_RSS = """
import resource, subprocess, sys
result = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stderr.write(result.stderr)
sys.stdout.write(result.stdout)
print("MAXRSS_KB", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, result.returncode)
"""


def predict_with_peak_memory(*args: str) -> tuple[dict, int, int]:
    """(the --json entry of the single file, the exit status, predict's peak resident memory in MB)."""
    measured = subprocess.run(
        [sys.executable, "-c", MAX_RSS, *covidxray_cmd("predict", *args)],
        capture_output=True,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        timeout=300,
    )
    document, _, tail = measured.stdout.rpartition("MAXRSS_KB")
    rss_kb, code = map(int, tail.split())
    return json.loads(document)[0], code, rss_kb // 1024


def test_n14b_predict_refuses_it_from_the_header_without_decoding(exported_run, tmp_path):
    path = tmp_path / "jpeg_30000sq_sof_after_128k.jpg"
    path.write_bytes(jpeg_with_sof_after(np.full((64, 64), 128, np.uint8), 128 << 10, 30000, 30000))
    entry, code, peak_mb = predict_with_peak_memory("--model", str(exported_run), "--json", str(path))
    assert code == 1 and entry["reason"] == "too-large" and "header declares 30000x30000" in entry["error"]
    assert peak_mb < 400, peak_mb  # decoding 30000 x 30000 would take 900 MB and more


def test_n14b_opencv_refuses_a_size_no_header_check_reads(exported_run, tmp_path):
    """A PGM (a format the header reader does not parse, which OpenCV decodes whatever the suffix) declaring
    30000 x 30000: OpenCV's own limit, set by predict from data.max_pixels, refuses it before allocating."""
    path = tmp_path / "scan.png"
    path.write_bytes(b"P5\n30000 30000\n255\n" + bytes(4096))
    entry, code, peak_mb = predict_with_peak_memory("--model", str(exported_run), "--json", str(path))
    assert code == 1 and entry["reason"] == "too-large" and "OPENCV_IO_MAX_IMAGE_PIXELS=16000000" in entry["error"]
    assert peak_mb < 400, peak_mb


def test_n15_a_real_18_mp_film_is_refused_with_the_way_to_raise_the_limit_and_then_classified(
    exported_run, shared_data, tmp_path
):
    film = cv2.imread(
        str(shared_data / "chest-xray-pneumonia-originals" / "chest_xray" / "train" / "NORMAL" / "IM-0117-0001.jpeg"),
        cv2.IMREAD_GRAYSCALE,
    )
    path = tmp_path / "film-4300.png"
    cv2.imwrite(str(path), cv2.resize(film, (4300, 4300)))
    refused = run_cli("predict", "--model", str(exported_run), "--json", str(path))
    entry = json.loads(refused.stdout)[0]
    assert refused.returncode == 1 and entry["reason"] == "too-large"
    assert "--set data.max_pixels=" in entry["error"]
    raised = run_cli("predict", "--model", str(exported_run), "--json", "--set", "data.max_pixels=20000000", str(path))
    entry = json.loads(raised.stdout)[0]
    assert "error" not in entry, entry  # decoded: classified or refused by the gate, not by its size
    bad = run_cli("predict", "--model", str(exported_run), "--set", "data.max_pixels=-1", str(path))
    assert_clear_error(bad, "data.max_pixels")


# --- N11b, N17c, links: predict tells what it did ----------------------------------------------------------------


TOTAL = 6000  # hard links to one film: far more than predict does in the seconds before the interrupt


@pytest.mark.parametrize("mode", ["--jsonl", "--json", "text"])
def test_n11b_ctrl_c_keeps_what_was_printed_and_says_what_is_left(exported_run, synthetic_data, tmp_path, mode):
    folder = tmp_path / "many"
    folder.mkdir()
    source = held_out_images(synthetic_data, 1)[0]
    for i in range(TOTAL):
        os.link(source, folder / f"{i:05d}.png")
    process = subprocess.Popen(
        covidxray_cmd("predict", "--model", str(exported_run), str(folder), *([mode] if mode != "text" else [])),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        preexec_fn=with_default_sigint,
    )
    try:
        if mode != "--json":  # streamed: interrupt once results are coming out
            first = process.stdout.readline()
            assert first.strip(), process.stderr.read()
        else:  # one document at the end: interrupt once the model is surely loaded and some files are done
            import time

            time.sleep(15)
        process.send_signal(signal.SIGINT)
        rest, stderr = process.communicate(timeout=120)
    finally:
        process.kill()  # a failed assertion must not leave predict running through 6,000 files
    out = (first if mode != "--json" else "") + rest
    assert process.returncode == 130, stderr[-2000:]
    message = one_line(stderr)
    assert "Traceback" not in stderr and "resume" not in message
    if mode == "--json":
        entries = json.loads(out)
        check_schema(entries)
    elif mode == "--jsonl":
        entries = [json.loads(line) for line in out.splitlines()]
        check_schema(entries)
    else:
        entries = out.splitlines()
        assert all(line.startswith(str(folder)) for line in entries)
    done = len(entries)
    assert 0 < done < TOTAL, done
    assert f"{done} of {TOTAL} file(s) done" in message and f"{TOTAL - done} not classified" in message, message
    assert f"from {folder / f'{done:05d}.png'} on" in message


def test_n11b_jsonl_lines_are_the_json_entries(exported_run, synthetic_data):
    images = [str(p) for p in held_out_images(synthetic_data, 3)]
    lines = run_cli("predict", "--model", str(exported_run), "--jsonl", *images, "/no/such.png")
    document = run_cli("predict", "--model", str(exported_run), "--json", *images, "/no/such.png")
    assert lines.returncode == document.returncode == 1
    assert [json.loads(line) for line in lines.stdout.splitlines()] == json.loads(document.stdout)
    both = run_cli("predict", "--model", str(exported_run), "--json", "--jsonl", images[0])
    assert_clear_error(both, "choose one")


def without_read_permission_override() -> list[str]:
    """A command prefix under which chmod 000 holds: as root, drop the capabilities that ignore it."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: chmod 000 cannot be tested")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


def test_n17c_links_and_unreadable_folders_and_files_are_listed_not_skipped(exported_run, synthetic_data, tmp_path):
    good = held_out_images(synthetic_data, 1)[0]
    folder = tmp_path / "pin"
    for sub in ("open", "locked"):
        (folder / sub).mkdir(parents=True)
        shutil.copy(good, folder / sub / "a_good_normal.png")
    shutil.copy(good, folder / "unreadable.png")
    (folder / "dangling.png").symlink_to(tmp_path / "nonexistent.png")
    (folder / "IM0002").symlink_to("/nonexistent/IM0002")
    (folder / "self.png").symlink_to(folder / "self.png")
    (folder / "loop").symlink_to(".")
    (folder / "notes.txt").symlink_to("/nonexistent/notes.txt")  # not an image by name: not an input
    os.chmod(folder / "locked", 0)
    os.chmod(folder / "unreadable.png", 0)
    try:
        result = subprocess.run(
            [*without_read_permission_override(), *covidxray_cmd("predict", "--model", str(exported_run), "--json")]
            + [str(folder)],
            capture_output=True,
            text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
            timeout=300,
        )
    finally:
        os.chmod(folder / "locked", 0o755)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    document = json.loads(result.stdout)
    check_schema(document)
    by_name = {Path(entry["file"]).name: entry for entry in document}
    assert set(by_name) == {
        "IM0002",
        "a_good_normal.png",
        "dangling.png",
        "locked",
        "loop",
        "self.png",
        "unreadable.png",
    }
    assert "label" in by_name["a_good_normal.png"] or "rejected" in by_name["a_good_normal.png"]
    assert by_name["locked"]["reason"] == "unreadable" and "cannot read the folder" in by_name["locked"]["error"]
    assert (
        by_name["unreadable.png"]["reason"] == "unreadable"
        and "cannot read the file" in by_name["unreadable.png"]["error"]
    )
    assert by_name["dangling.png"]["reason"] == "missing" and "a broken link" in by_name["dangling.png"]["error"]
    assert by_name["IM0002"]["reason"] == "missing" and "a broken link" in by_name["IM0002"]["error"]
    assert by_name["self.png"]["reason"] == "missing" and "a link in a loop" in by_name["self.png"]["error"]
    assert by_name["loop"]["reason"] == "unsupported" and "not followed" in by_name["loop"]["error"]
    for name in by_name:
        if "error" in by_name[name]:
            assert name in result.stderr
