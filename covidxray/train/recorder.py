"""Rank 0's files of a training run: the train log, checkpoints, the best model with its card, TensorBoard points.

Only rank 0 holds a `RunRecorder` (an elastic job gives the new rank 0 one at its next attempt); every other rank
holds None and records nothing. `EndOfEpoch` (covidxray/train/trainer.py) calls it in the order the commit
protocol needs: `log` the epoch, then `checkpoint` (its folder, the best model and card when this epoch is the
best, then `checkpoints/latest.json`, the commit point of a resumable run), then, after the state is committed,
`epoch_point`, so TensorBoard only shows epochs a resume or rollback keeps. Every write is atomic.
"""

from __future__ import annotations

import os
import secrets
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import tensorflow as tf

from covidxray.files import PARTIAL
from covidxray.run_folder import (
    CHECKPOINTS,
    MODEL_FILE,
    TRAIN_LOG,
    ModelCard,
    write_json,
    write_latest,
    write_model_card,
)
from covidxray.train import source_adversary
from covidxray.train.state import TrainingState
from covidxray.train.tensorboard import EpochBoard

KEEP_CHECKPOINTS = 2


class RunRecorder:
    """Rank 0's writer of `run_dir`: resumable checkpoints of `checkpoint` (model + optimizer), the best model with
    `card` (its `best` filled in), and `board`'s TensorBoard points (None: train.tensorboard is off)."""

    def __init__(self, run_dir: Path, checkpoint: tf.train.Checkpoint, card: ModelCard, board: EpochBoard | None):
        self.run_dir, self.checkpoint, self.card, self.board = Path(run_dir), checkpoint, card, board

    def log(self, header: dict, history: list[dict]) -> None:
        """The train log: the attempt's header and every epoch so far."""
        write_json(self.run_dir / TRAIN_LOG, {**header, "epochs": history})

    def checkpoint_epoch(self, training: TrainingState, model: tf.keras.Model) -> None:
        """Resumable checkpoint (model + optimizer), the best model if this epoch is it, then latest.json.

        Folder names are unique, so the folder latest.json names is never
        rewritten in place (an elastic job may redo an epoch it had saved).
        """
        root = self.run_dir / CHECKPOINTS
        root.mkdir(parents=True, exist_ok=True)
        name = f"epoch-{training.epoch:04d}-{secrets.token_hex(4)}"
        tmp = root / f".{name}{PARTIAL}"
        self.checkpoint.write(str(tmp / "ckpt"))
        os.replace(tmp, root / name)
        if training.best.get("epoch") == training.epoch:
            self.save_best_model(model, training.best)
        write_latest(
            self.run_dir,
            {
                "epoch": training.epoch,
                "path": name,
                "best": training.best,
                "epochs_since_best": training.epochs_since_best,
                "optimizer_steps": int(model.optimizer.iterations.numpy()),
            },
        )
        older = [p for p in sorted(root.glob("epoch-*")) if p.name != name]
        for old in older[: max(0, len(older) - (KEEP_CHECKPOINTS - 1))]:
            shutil.rmtree(old, ignore_errors=True)

    def save_best_model(self, model: tf.keras.Model, best: dict) -> None:
        # A prefix, not files.atomic_path's suffix: Keras saves only to a name ending in .keras.
        model_tmp = self.run_dir / (PARTIAL + "." + MODEL_FILE)
        classifier = source_adversary.inference_model(model)  # without a training-only source head
        inference_copy = tf.keras.models.clone_model(classifier)  # uncompiled: no (Horovod) optimizer inside
        inference_copy.set_weights(classifier.get_weights())
        inference_copy.save(str(model_tmp))
        os.replace(model_tmp, self.run_dir / MODEL_FILE)
        write_model_card(self.run_dir, replace(self.card, best=best))

    def epoch_point(self, entry: dict, confusion: np.ndarray) -> None:
        """A committed epoch's TensorBoard point (nothing when TensorBoard is off)."""
        if self.board:
            self.board.write(entry, confusion)

    def close(self) -> None:
        if self.board:
            self.board.close()
