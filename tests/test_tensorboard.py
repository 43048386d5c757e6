"""Issue 29: TensorBoard event files, read back with TensorBoard's own EventAccumulator as the oracle."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli


def read_board(log_dir: Path) -> dict[str, list[tuple[int, object]]]:
    """tag -> [(step, value)] in file order, as TensorBoard loads it (scalars as floats, images as PNG bytes)."""
    import tensorflow as tf
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    accumulator.Reload()
    board = {}
    for tag in accumulator.Tags()["tensors"]:
        values = [(event.step, tf.make_ndarray(event.tensor_proto)) for event in accumulator.Tensors(tag)]
        board[tag] = [(step, value[2] if value.ndim else float(value)) for step, value in values]
    return board


def expected_scalars(entry: dict) -> dict[str, float]:
    """The tags one train_log.json entry must appear under, written out independently of epoch_scalars."""
    rates = entry["images_per_s_per_rank"]
    expected = {
        "train/loss": entry["loss"],
        "train/accuracy": entry["accuracy"],
        "train/learning_rate": entry["lr"],
        "validation/loss": entry["val_loss"],
        "validation/accuracy": entry["val_accuracy"],
        "validation/auc": entry["val_auc"],
        "validation/predicted_classes": entry["val_predicted_classes"],
        "throughput/images_per_s_slowest_rank": min(rates),
        "throughput/slowest_rank": rates.index(min(rates)),
        "throughput/images_per_s_total": sum(rates),
        "time/epoch_seconds": entry["seconds"],
        "cluster/world_size": entry["world_size"],
    }
    expected.update({f"throughput/images_per_s_rank_{rank}": rate for rank, rate in enumerate(rates)})
    return expected


def assert_board_matches_log(run_dir: Path, images_for: set[int] | None, rank_local: bool = False) -> None:
    """Every epoch of train_log.json once in the event files, with the log's values; confusion images at `images_for`
    (None: at any of the steps). `rank_local`: the run changed rank 0 (elastic), so an epoch's training seconds,
    which each rank times itself, may be the old rank 0's in the event files and the new one's in the log."""
    import cv2

    epochs = json.loads((run_dir / "train_log.json").read_text())["epochs"]
    board = read_board(run_dir / "tensorboard")
    steps = [e["epoch"] for e in epochs]
    for tag, points in board.items():  # no step twice, none the log lacks, in order
        assert [step for step, _ in points] == sorted({step for step, _ in points}), tag
        assert {step for step, _ in points} <= set(steps), tag
    for entry in epochs:  # each tag of each epoch once, with the log's value (a rank's tag only while it ran)
        for tag, value in expected_scalars(entry).items():
            if rank_local and tag == "time/epoch_seconds":
                continue
            at_step = [v for step, v in board.get(tag, []) if step == entry["epoch"]]
            assert at_step == [pytest.approx(value, rel=1e-6)], (entry["epoch"], tag, at_step)
    images = board.get("validation/confusion_matrix", [])
    image_steps = [step for step, _ in images]
    assert image_steps == sorted(images_for) if images_for is not None else set(image_steps) <= set(steps)
    for _, png in images:
        picture = cv2.imdecode(np.frombuffer(png, np.uint8), cv2.IMREAD_COLOR)
        assert picture is not None and picture.std() > 0  # a real, non-blank PNG


def test_a_training_run_writes_every_logged_metric_once_per_epoch(trained_run):
    epochs = json.loads((trained_run / "train_log.json").read_text())["epochs"]
    assert_board_matches_log(trained_run, images_for={e["epoch"] for e in epochs})


def _entry(epoch: int) -> dict:
    return {
        "epoch": epoch,
        "seconds": 2.0 + epoch,
        "lr": 1e-3 / epoch,
        "world_size": 2,
        "steps": 5,
        "images_per_s_per_rank": [100.0 + epoch, 90.0],
        "loss": 1.0 / epoch,
        "accuracy": 0.5 + epoch / 100,
        "val_loss": 1.2 / epoch,
        "val_accuracy": 0.4 + epoch / 100,
        "val_auc": 0.6 + epoch / 100,
        "val_predicted_classes": 2.0,
    }


def test_a_restart_writes_only_the_epochs_the_event_files_lack(tmp_path):
    """Crash after committing epoch 3 but before writing it: the next board writes 3 from the history, and
    neither it nor a redone epoch 2 is written twice; a truncated last record (killed writer) is skipped."""
    from covidxray.train.tensorboard import EpochBoard

    log_dir, labels = tmp_path / "tensorboard", ["normal", "pneumonia"]
    first = EpochBoard(log_dir, labels, [])
    for epoch in (1, 2):
        first.write(_entry(epoch), np.array([[3, 1], [0, 4]]))
    first.close()
    with open(next(log_dir.glob("events.out.tfevents.*")), "ab") as events:
        events.write(b"\x20\x00\x00\x00\x00\x00\x00\x00half a record")

    second = EpochBoard(log_dir, labels, [_entry(1), _entry(2), _entry(3)])
    second.write({**_entry(2), "loss": 99.0}, np.eye(2, dtype=int))  # an epoch redone after a rollback
    second.write(_entry(4), np.eye(2, dtype=int))
    second.close()

    board = read_board(log_dir)
    assert [step for step, _ in board["train/loss"]] == [1, 2, 3, 4]
    assert [value for _, value in board["train/loss"]] == pytest.approx([1.0, 0.5, 1 / 3, 0.25])
    assert [step for step, _ in board["validation/confusion_matrix"]] == [1, 2, 4]  # 3 came from the history
    assert [value for _, value in board["throughput/slowest_rank"]] == [1, 1, 1, 1]


def test_tensorboard_false_writes_no_event_files(synthetic_data, tmp_path):
    run_dir = tmp_path / "run"
    args = ["train", "--data-dir", str(synthetic_data), "--run-dir", str(run_dir), "--epochs", "1"]
    result = run_cli(*args, "--set", "train.tensorboard=false")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "train_log.json").is_file() and not (run_dir / "tensorboard").exists()
    wrong = run_cli(*args, "--set", "train.tensorboard=sometimes")
    assert wrong.returncode == 2 and "config.train.tensorboard: expected true/false" in wrong.stderr


def test_curves_start_afresh_exactly_when_training_starts_from_epoch_0(tmp_path):
    from covidxray.run_folder import write_latest
    from covidxray.train.trainer import _prepare_run_dir

    board = tmp_path / "tensorboard"
    board.mkdir()
    _prepare_run_dir(tmp_path, resume=True, say=print)  # --resume, but no checkpoint: epoch 1 is a new run's
    assert not board.exists()
    board.mkdir()
    (tmp_path / "checkpoints").mkdir()
    write_latest(tmp_path, {"epoch": 2, "path": "epoch-0002-x"})
    _prepare_run_dir(tmp_path, resume=True, say=print)  # a checkpoint to continue: its curves continue too
    assert board.is_dir()
    _prepare_run_dir(tmp_path, resume=False, say=print)  # started over: checkpoints and curves go
    assert not board.exists() and not (tmp_path / "checkpoints").exists()
