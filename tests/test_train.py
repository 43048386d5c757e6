"""Issue 4: training input, state bookkeeping and resume after `kill -9`."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import covidxray_cmd, run_cli
from test_tensorboard import assert_board_matches_log

from covidxray.manifest import open_prepared
from covidxray.run_folder import ModelCard
from covidxray.train.input import assign_shards, rank_records


def _record_ids(dataset) -> list[str]:
    import tensorflow as tf

    from covidxray.data.tfrecord import FEATURES

    return [tf.io.parse_single_example(raw, FEATURES)["record_id"].numpy().decode() for raw in dataset]


def test_file_level_shards_are_disjoint_and_cover_every_file():
    paths = [Path(f"train-{i:05d}.tfrecord") for i in range(7)]
    per_rank = [assign_shards(paths, rank, 3) for rank in range(3)]
    files = [set(s.files) for s in per_rank]
    assert not any(s.record_level for s in per_rank)
    assert all(files) and set.union(*files) == {str(p) for p in paths}
    assert sum(len(f) for f in files) == len(paths)


@pytest.mark.parametrize("training", [False, True])
def test_record_level_fallback_splits_records_disjointly(synthetic_data, training):
    """More ranks than files: every rank reads all files in one shared order and keeps every size-th record."""
    paths = open_prepared(synthetic_data).shards("val")
    size = len(paths) + 1
    everything = _record_ids(rank_records(assign_shards(paths, 0, 1), 0, 1, False, seed=0))
    per_rank = []
    for rank in range(size):
        shards = assign_shards(paths, rank, size)
        assert shards.record_level
        per_rank.append(_record_ids(rank_records(shards, rank, size, training, seed=5)))
    assert all(per_rank)
    assert sum(len(ids) for ids in per_rank) == len(everything)
    assert set().union(*per_rank) == set(everything)


def test_class_weights_balance_the_classes():
    from covidxray.train.trainer import class_weights

    counts = {"normal": 300, "pneumonia": 100, "covid-19": 50}
    weights = class_weights(counts, list(counts))
    per_class_total = [weights[i] * counts[c] for i, c in enumerate(counts)]
    assert max(per_class_total) == pytest.approx(min(per_class_total))
    assert sum(per_class_total) == pytest.approx(sum(counts.values()))  # mean weight over samples is 1
    assert class_weights({"normal": 5, "covid-19": 0}, ["normal", "covid-19"])[1] == 0.0
    # square root: weight ~ 1/sqrt(count), mean 1 over the samples (worked out by hand for 400 / 100)
    sqrt = class_weights({"normal": 400, "covid-19": 100}, ["normal", "covid-19"], power=0.5)
    assert sqrt[1] / sqrt[0] == pytest.approx(2.0) and 400 * sqrt[0] + 100 * sqrt[1] == pytest.approx(500)


def test_training_state_keeps_best_val_auc_and_stops_after_patience():
    from dataclasses import replace

    from covidxray.train.state import TrainingState
    from covidxray.train.trainer import clean_metrics

    state = TrainingState()
    for epoch, auc in enumerate([0.6, 0.7, 0.65, float("nan")], start=1):
        state = replace(state, epoch=epoch).judged(clean_metrics({"val_auc": auc, "loss": 1.0}))
    assert state.best["epoch"] == 2 and state.best["val_auc"] == 0.7
    assert state.epochs_since_best == 2 and state.stopped_early(patience=2)  # a NaN AUC is no improvement
    assert not state.stopped_early(patience=3) and not state.stopped_early(patience=0)  # 0: never stop early


def _two_feature_validation_set():
    """Feature 0 is the label itself, feature 1 noise: a kernel reading feature 0 scores val AUC 1, its negation 0."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(3)
    labels = np.arange(40) % 2
    features = np.stack([labels, rng.uniform(-1, 1, 40)], axis=1).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((features, np.eye(2, dtype=np.float32)[labels])).batch(16)


def _two_feature_model():
    import tensorflow as tf

    model = tf.keras.Sequential([tf.keras.layers.Dense(2, activation="softmax", input_shape=(2,))])
    model.compile(optimizer=tf.keras.optimizers.Adam(), loss="categorical_crossentropy")
    model.optimizer.build(model.trainable_variables)
    return model, tf.train.Checkpoint(model=model, optimizer=model.optimizer)


def test_each_epoch_end_checkpoints_the_best_and_early_stopping_state_it_decided(tmp_path):
    """Epoch by epoch, the files on disk carry the decision of that very epoch, in log -> decide -> checkpoint order.

    The val AUC of each epoch is set by hand (noise, 1, 0, 0), so the best epoch and the early-stopping
    count are known in advance: best is epoch 2 from then on, and patience 2 stops training after epoch 4.
    """
    import numpy as np

    from covidxray.train.distributed import StaticState, World
    from covidxray.train.recorder import RunRecorder
    from covidxray.train.state import TrainingState
    from covidxray.train.trainer import EndOfEpoch, _restore

    model, checkpoint = _two_feature_model()
    world, said = World(), []
    state = StaticState(world, model, model.optimizer, TrainingState())
    end_of_epoch = EndOfEpoch(
        world,
        state,
        val_ds=_two_feature_validation_set(),
        recalibration=None,
        patience=2,
        header={"steps_per_epoch": 1},
        images_per_epoch=16,
        say=said.append,
        recorder=RunRecorder(
            tmp_path, checkpoint, ModelCard(labels=["a", "b"], image_size=64, model="two-feature"), None
        ),
    )
    end_of_epoch.set_model(model)
    reads_noise, reads_label, reads_negated_label = [[0, 0], [0, 1]], [[0, 1], [0, 0]], [[1, 0], [0, 0]]
    kernels = [reads_noise, reads_label, reads_negated_label, reads_negated_label]
    expected = [(1, 0, False), (2, 0, False), (2, 1, False), (2, 2, True)]  # (best epoch, epochs since best, stop)
    for epoch, (kernel, (best_epoch, since_best, stop)) in enumerate(zip(kernels, expected)):
        model.layers[0].set_weights([np.array(kernel, np.float32), np.zeros(2, np.float32)])
        committed = state.training
        model.stop_training = False
        end_of_epoch.on_epoch_begin(epoch)
        end_of_epoch.on_epoch_end(epoch, {"loss": 1.0})

        latest = json.loads((tmp_path / "checkpoints" / "latest.json").read_text())
        assert (latest["epoch"], latest["best"]["epoch"], latest["epochs_since_best"]) == (
            epoch + 1,
            best_epoch,
            since_best,
        )
        assert model.stop_training == stop
        logged = json.loads((tmp_path / "train_log.json").read_text())["epochs"]
        assert [e["epoch"] for e in logged] == list(range(1, epoch + 2))  # logged before the checkpoint
        assert latest["best"]["val_auc"] == logged[best_epoch - 1]["val_auc"]
        card = json.loads((tmp_path / "model.json").read_text())
        assert card["best"] == latest["best"] and card["model"] == "two-feature"
        # The committed state is what the files say, and the one committed before was not changed in place
        # (Horovod's elastic state rolls back to that very object).
        assert state.training == _restore(tmp_path, _two_feature_model()[1])
        assert len(committed.history) == epoch and committed.epoch == epoch

    assert logged[0]["val_auc"] not in (0.0, 1.0) and [e["val_auc"] for e in logged[1:]] == [1.0, 0.0, 0.0]
    import tensorflow as tf

    best_model = tf.keras.models.load_model(tmp_path / "model.keras")
    np.testing.assert_array_equal(best_model.layers[0].get_weights()[0], reads_label)  # saved at epoch 2, not after
    restored_model, restored_checkpoint = _two_feature_model()
    _restore(tmp_path, restored_checkpoint)
    np.testing.assert_array_equal(restored_model.layers[0].get_weights()[0], reads_negated_label)  # epoch 4's weights


def test_elastic_flag_must_match_the_launch(monkeypatch):
    from covidxray.errors import UserError
    from covidxray.train.distributed import check_launch_mode

    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    with pytest.raises(UserError, match="min-np"):
        check_launch_mode(True)
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    with pytest.raises(UserError, match="--elastic"):
        check_launch_mode(False)
    check_launch_mode(True)


def _latest_epoch(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / "checkpoints" / "latest.json").read_text())["epoch"]
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.slow
def test_kill_9_mid_epoch_then_resume_ends_with_the_same_epochs(synthetic_data, tmp_path):
    run_dir, epochs = tmp_path / "run", 4
    args = [
        "train",
        "--data-dir",
        str(synthetic_data),
        "--run-dir",
        str(run_dir),
        "--epochs",
        str(epochs),
        "--batch-size",
        "8",
    ]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    process = subprocess.Popen(covidxray_cmd(*args), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while _latest_epoch(run_dir) < 1 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # well inside epoch 2 (an epoch here takes a few seconds)
        assert process.poll() is None, "training finished before it could be killed"
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    killed_at = _latest_epoch(run_dir)
    assert 1 <= killed_at < epochs

    result = run_cli(*args, "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming after epoch {killed_at}" in result.stderr
    log = json.loads((run_dir / "train_log.json").read_text())
    assert [e["epoch"] for e in log["epochs"]] == list(range(1, epochs + 1))
    # the optimizer (step count, Adam moments) came back with the weights: no step was lost or repeated
    assert log["optimizer_steps"] == epochs * log["steps_per_epoch"]
    # the LR curve continued where it stopped: one warmup epoch, then cosine to 0 (written out independently)
    peak, warmup = 1e-3, 1
    expected = [
        peak if e <= warmup else peak * 0.5 * (1 + math.cos(math.pi * (e - warmup) / (epochs - warmup)))
        for e in range(1, epochs + 1)
    ]
    assert [e["lr"] for e in log["epochs"]] == pytest.approx(expected, abs=1e-9)
    latest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert latest["epoch"] == epochs and (run_dir / "checkpoints" / latest["path"] / "ckpt.index").is_file()
    leftovers = [p for p in run_dir.rglob("*") if "partial" in p.name]
    assert not leftovers, leftovers
    assert (run_dir / "model.keras").is_file() and json.loads((run_dir / "model.json").read_text())["best"][
        "epoch"
    ] <= epochs
    # TensorBoard continued the same curves: every epoch once, with the log's values (tests/test_tensorboard.py)
    assert_board_matches_log(run_dir, images_for=set(range(1, epochs + 1)))


def test_shipped_configs_load_and_default_yaml_is_the_defaults():
    from covidxray.config import Config, load_config
    from covidxray.train.models import MODEL_REGISTRY

    repo = Path(__file__).resolve().parents[1]
    assert load_config(repo / "configs" / "default.yaml") == Config()
    cluster = load_config(repo / "configs" / "pi-cluster.yaml")
    assert cluster.train.model in MODEL_REGISTRY and cluster.train.warmup_epochs > 0


def test_application_backbone_loads_a_local_weights_file_and_refuses_a_wrong_one(tmp_path):
    """The stand-in for Keras' downloaded ImageNet file: no network, and a wrong file is an error, not ignored."""
    import numpy as np
    import tensorflow as tf

    from covidxray.errors import UserError
    from covidxray.train.models import build_model

    backbone = tf.keras.applications.MobileNetV3Small(
        include_top=False, weights=None, input_shape=(64, 64, 3), pooling="avg"
    )
    weights = tmp_path / "mobilenet_v3_small_no_top.h5"
    backbone.save_weights(str(weights))
    model = build_model("mobilenet_v3_small", 64, 3, str(weights))
    (inner,) = [layer for layer in model.layers if isinstance(layer, tf.keras.Model)]
    assert all(np.array_equal(a, b) for a, b in zip(inner.get_weights(), backbone.get_weights()))
    with pytest.raises(UserError, match="efficientnet_b0"):
        build_model("efficientnet_b0", 64, 3, str(weights))
    with pytest.raises(UserError, match="not found"):
        build_model("small_cnn", 64, 3, str(tmp_path / "missing.h5"))


def test_building_the_augmenter_never_contacts_the_network():
    """albumentations asks PyPI for updates on import; training on a hospital or air-gapped network must not."""
    probe = (
        "import os, socket, urllib.request\n"
        "os.environ.pop('NO_ALBUMENTATIONS_UPDATE', None)\n"
        "calls = []\n"
        "def refuse(*args, **kwargs):\n"
        "    calls.append(args)\n"
        "    raise OSError('network access attempted')\n"
        "urllib.request.OpenerDirector.open = refuse\n"
        "socket.create_connection = refuse\n"
        "from covidxray.train.input import _augmenter\n"
        "_augmenter()\n"
        "print(len(calls))\n"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", probe], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-1] == "0"


@pytest.mark.parametrize("strength", [1.0, 2.0])
def test_augment_strength_scales_the_brightness_contrast_range(strength):
    """Oracle: the centre of a flat image (no border fill reaches it) becomes v*alpha + 255*beta with probability
    0.8, alpha ~ U(1 - 0.12s, 1 + 0.12s), beta ~ U(-0.12s, 0.12s): standard deviation
    sqrt(0.8) * 0.12s * sqrt((v^2 + 255^2) / 3)."""
    import random

    import numpy as np

    from covidxray.train.input import _augmenter

    np.random.seed(0)  # albumentations draws from numpy's and Python's global generators
    random.seed(0)
    augmenter, value = _augmenter(strength), 100.0
    flat = np.full((64, 64, 1), value, np.uint8)
    centres = np.array([augmenter(image=flat)["image"][32, 32, 0] for _ in range(3000)], float)
    expected = math.sqrt(0.8) * 0.12 * strength * math.sqrt((value**2 + 255**2) / 3)
    assert np.std(centres) == pytest.approx(expected, rel=0.08)
