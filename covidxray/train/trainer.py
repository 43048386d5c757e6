"""`covidxray train`: Keras fit over the shards, single process or one Horovod rank of many.

Only rank 0 touches the run folder, through its `RunRecorder` (covidxray/train/recorder.py).
Every write there is atomic (temp file or folder, then rename), and
`checkpoints/latest.json` is the commit point: it names a complete checkpoint
folder, so a run killed at any instant resumes from the last finished epoch
with its optimizer state (`--resume`).

What rank 0 would need to carry on (epoch, history, best score, early-stopping
count) is a `TrainingState` replicated on every rank, so that in an elastic job
any survivor can take over as rank 0 with the full history. `EndOfEpoch` is
the one place that changes it, in one visible order: validate, average the
metrics over the ranks, log, decide best and early stopping, checkpoint,
commit.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow as tf

from covidxray.config import Config, DataConfig, TrainConfig
from covidxray.data.labels import get_task, require_every_class
from covidxray.edge.preprocess import PREPROCESSING_VERSION
from covidxray.errors import UserError
from covidxray.files import PARTIAL
from covidxray.manifest import MANIFEST, Manifest, PreparedData, open_prepared
from covidxray.run_folder import (
    CHECKPOINTS,
    CONFIG_FILE,
    LATEST,
    TENSORBOARD_DIR,
    TRAIN_LOG,
    ModelCard,
    read_latest,
    write_json,
)
from covidxray.train import source_adversary
from covidxray.train.batchnorm import batches_per_rank, recompute_statistics
from covidxray.train.distributed import HorovodTuning, World, check_launch_mode, init_world
from covidxray.train.finetune import hold_fixed
from covidxray.train.input import InputSpec, make_dataset, predict_batches
from covidxray.train.metrics import confusion_matrix, cross_entropy, macro_auc
from covidxray.train.models import build_model
from covidxray.train.recorder import RunRecorder
from covidxray.train.run_guard import check_before_training
from covidxray.train.schedule import LearningRateSchedule
from covidxray.train.source_balance import class_weights_in_stream, source_aware, train_sources
from covidxray.train.state import MONITOR, PREDICTED_CLASSES, TrainingState
from covidxray.train.tensorboard import EpochBoard


def class_weights(counts: dict[str, int], labels: list[str], power: float = 1.0) -> dict[int, float]:
    """Weights proportional to count^-power, scaled to mean 1 over the samples, so a rare class is not ignored.

    power 1 is inverse frequency (each class carries the same total weight); 0.5 (square root) tempers the
    weight of a very rare class, e.g. 25 covid-19 images among 4000 get 8.8 instead of 54.
    """
    total = sum(counts.get(c, 0) for c in labels)
    raw = {c: counts[c] ** -power for c in labels if counts.get(c, 0)}
    scale = total / sum(counts[c] * w for c, w in raw.items()) if raw else 0.0
    return {i: raw[c] * scale if c in raw else 0.0 for i, c in enumerate(labels)}


def clean_metrics(logs: dict) -> dict:
    """Keras logs -> JSON-safe floats (an undefined metric is None, not NaN)."""
    values = {k: float(v) for k, v in (logs or {}).items()}
    return {k: (None if math.isnan(v) else v) for k, v in values.items()}


def validation_metrics(world: World, model: tf.keras.Model, dataset: tf.data.Dataset) -> tuple[dict, np.ndarray]:
    """Validation metrics from every rank's slice of the val split, gathered into one exact set, and its confusion matrix.

    Each rank predicts only its share, so validation costs 1/size of the
    split per rank; the gathered predictions give the true AUC of the whole
    split (an average of per-rank AUCs would not be), identical on all ranks.
    """
    gathered = world.allgather_object(predict_batches(model, dataset, model.output_shape[-1]))
    probs = np.concatenate([p for p, _ in gathered])
    truth = np.concatenate([t for _, t in gathered])
    auc = macro_auc(truth, probs)
    metrics = {
        "val_loss": cross_entropy(truth, probs),
        "val_accuracy": float((probs.argmax(1) == truth).mean()),
        MONITOR: float("nan") if auc is None else auc,
        PREDICTED_CLASSES: len(np.unique(probs.argmax(1))),
    }
    return metrics, confusion_matrix(truth, probs.argmax(1), probs.shape[1])


class EndOfEpoch(tf.keras.callbacks.Callback):
    """Everything between two epochs, in one fixed order, on every rank; the one callback that reads or changes the state.

    `state` is the object of World.make_state; `state.training` is the
    TrainingState committed after the last finished epoch. `recalibration`:
    (training data, batches per rank) to re-estimate the BN statistics from,
    or None. `recorder`: rank 0's writer of the run folder, None on every
    other rank.
    """

    def __init__(
        self,
        world: World,
        state,
        *,
        val_ds: tf.data.Dataset,
        recalibration: tuple[tf.data.Dataset, int] | None,
        patience: int,
        header: dict,
        images_per_epoch: int,
        say: Callable[[str], None],
        recorder: RunRecorder | None,
    ):
        super().__init__()
        self.world, self.state, self.val_ds, self.recalibration = world, state, val_ds, recalibration
        self.patience, self.header, self.images_per_epoch = patience, header, images_per_epoch
        self.say, self.recorder = say, recorder
        self.average_over_ranks = world.metric_averager()
        self.started = self.last_batch_end = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self.started = self.last_batch_end = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.last_batch_end = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        training = replace(self.state.training, epoch=epoch + 1)  # Keras counts from 0, the log and checkpoints from 1
        if self.recalibration:  # val and the saved model use statistics that fit the weights
            self.recalibrate_batchnorm(*self.recalibration)
        metrics, confusion = validation_metrics(self.world, self.model, self.val_ds)
        logs.update(metrics)
        self.average_over_ranks(epoch, logs)  # before any step reads a metric
        metrics = clean_metrics(logs)
        training = self.log_epoch(training, metrics)
        training = training.judged(metrics)
        if training.stopped_early(self.patience):
            self.model.stop_training = True
        if self.recorder:  # the checkpoint carries this epoch's best and early-stopping count
            self.recorder.checkpoint_epoch(training, self.model)
        self.commit(training)  # an elastic rollback returns to a finished epoch, never half of one
        if self.recorder:  # after the commit: TensorBoard only ever shows epochs a resume or rollback keeps
            self.recorder.epoch_point(training.history[-1], confusion)

    def recalibrate_batchnorm(self, dataset: tf.data.Dataset, batches: int) -> None:
        recompute_statistics(self.model, dataset.take(batches), self.world)

    def log_epoch(self, training: TrainingState, metrics: dict) -> TrainingState:
        """The epoch's history entry with every rank's training throughput, so a slow board shows up; rank 0 writes and says it."""
        seconds = max(self.last_batch_end - self.started, 1e-6)
        rates = self.world.allgather_object(round(self.images_per_epoch / seconds, 1))
        lr = float(tf.keras.backend.get_value(self.model.optimizer.learning_rate))
        entry = {
            "epoch": training.epoch,
            "seconds": round(seconds, 2),
            "lr": lr,
            "world_size": self.world.size,
            "steps": self.header["steps_per_epoch"],
            "images_per_s_per_rank": rates,
            **metrics,
        }
        training = training.logged(entry)
        if self.recorder:
            self.recorder.log(self.header, training.history)
            slowest = int(np.argmin(rates))
            if entry.get(PREDICTED_CLASSES) == 1:
                self.say(collapse_warning(training.epoch))
            self.say(
                f"epoch {training.epoch}: loss {entry.get('loss') or 0:.4f} val_auc {entry.get(MONITOR) or 0:.4f} "
                f"val_accuracy {entry.get('val_accuracy') or 0:.4f} | {sum(rates):.0f} img/s total, "
                f"slowest rank {slowest} at {rates[slowest]:.0f} img/s"
            )
        return training

    def commit(self, training: TrainingState) -> None:
        """Hand the finished epoch's state to every rank's state object; elastic: Horovod keeps it to roll back to."""
        self.state.training = training
        self.state.commit()


def collapse_warning(epoch: int) -> str:
    return (
        f"warning: after epoch {epoch} every validation image is predicted as the same class: the model is a "
        "constant predictor so far (see docs/training.md, 'A constant predictor')"
    )


def _restore(run_dir: Path, checkpoint: tf.train.Checkpoint) -> TrainingState | None:
    """Training state of the last complete checkpoint (model and optimizer are restored in place); None if none."""
    saved = read_latest(run_dir)
    if saved is None:
        return None
    if not (run_dir / CHECKPOINTS / saved["path"]).is_dir():
        raise UserError(
            f"{run_dir / CHECKPOINTS / LATEST} names checkpoint {saved['path']}, but that folder is missing (deleted or "
            "moved?); put it back to resume, or start over without --resume"
        )
    try:
        checkpoint.read(str(run_dir / CHECKPOINTS / saved["path"] / "ckpt")).assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.OpError) as err:
        raise UserError(
            f"{run_dir / CHECKPOINTS / LATEST}: checkpoint {saved['path']} does not fit this model/config ({err}); resume with the config it was trained with"
        ) from None
    log_path = run_dir / TRAIN_LOG
    try:
        history = json.loads(log_path.read_text()).get("epochs", []) if log_path.is_file() else []
    except (
        ValueError,
        AttributeError,
    ):  # a damaged log only loses the per-epoch history of a run whose weights are intact
        history = []
    return TrainingState(
        epoch=int(saved["epoch"]),
        history=[e for e in history if e["epoch"] <= saved["epoch"]],
        best=saved.get("best", {}),
        epochs_since_best=int(saved.get("epochs_since_best", 0)),
    )


def _prepare_run_dir(run_dir: Path, resume: bool, say: Callable[[str], None]) -> None:
    """Rank 0: drop half-written leftovers; without --resume, also the previous run's checkpoints; without a
    checkpoint to continue, its TensorBoard curves."""
    checkpoints = run_dir / CHECKPOINTS
    for leftover in [*run_dir.glob(f"*{PARTIAL}*"), *checkpoints.glob(f".*{PARTIAL}")]:
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    if not resume and checkpoints.exists():
        say(f"starting over in {run_dir}: removing the previous run's checkpoints (use --resume to continue it)")
        shutil.rmtree(checkpoints)
    if read_latest(run_dir) is None:  # training from epoch 0 (started over, or nothing to resume): curves afresh
        shutil.rmtree(run_dir / TENSORBOARD_DIR, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)


def train(config: Config, resume: bool = False, say: Callable[[str], None] = print, force: bool = False) -> dict:
    cfg = config.train
    check_launch_mode(cfg.elastic)
    world = init_world(HorovodTuning(cfg.gradient_compression, cfg.fusion_buffer_mb, cfg.cycle_time_ms))

    def root_say(message: str) -> None:  # asked at each call: an elastic job may hand rank 0 to another worker
        if world.is_root:
            say(message)

    data = open_prepared(config.data.data_dir)  # the one reading of the manifest: every step below uses `data`
    manifest = data.manifest
    require_every_class(get_task(manifest.task), manifest.splits["train"].classes, f"{data.path}'s train split")
    effective = effective_data_settings(config.data, data, root_say)
    with check_before_training(world, config, data, effective, resume, force, root_say):  # rank 0 holds the run folder
        return _train_checked(config, world, data, resume, root_say)


def effective_data_settings(configured: DataConfig, data: PreparedData, say: Callable[[str], None]) -> dict:
    """The data settings training uses: the prepared set's, not the config's (which only `prepare` applies); a word
    when the config says otherwise. Recorded in the model card and RUN_INPUTS; the config is left as given."""
    manifest = data.manifest
    effective = {"task": manifest.task, "image_size": manifest.image_size, "harmonise": manifest.harmonise}
    differ = [
        f"data.{key} {getattr(configured, key)!r} in the config, {value!r} in {data.path / MANIFEST}"
        for key, value in effective.items()
        if getattr(configured, key) != value
    ]
    if differ:
        say(
            f"note: training with the prepared data set's settings ({'; '.join(differ)}); `covidxray prepare` applies "
            "data settings: prepare again to change them"
        )
    return effective


def _compiled_model(cfg: TrainConfig, manifest: Manifest, world: World) -> tuple[tf.keras.Model, Any, Any]:
    """(the model to fit, with a source adversary head if configured, compiled; its distributed optimizer, built;
    what the training stream must know of sources, or None)."""
    tf.keras.utils.set_random_seed(cfg.seed)
    model = build_model(cfg.model, manifest.image_size, len(manifest.labels), cfg.weights)
    hold_fixed(model, cfg)
    steps = max(1, manifest.splits["train"].records // (cfg.batch_size * world.size)) * cfg.epochs
    model = source_adversary.wrap(model, len(train_sources(manifest)), cfg.source_adversary, steps)  # or the model
    by_source = source_aware(cfg, manifest, source_input=model is not source_adversary.inference_model(model))
    optimizer = world.distributed_optimizer(tf.keras.optimizers.Adam(cfg.learning_rate))
    loss = tf.keras.losses.CategoricalCrossentropy(label_smoothing=cfg.label_smoothing)
    model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
    optimizer.build(model.trainable_variables)
    return model, optimizer, by_source


def _starting_state(
    run_dir: Path, checkpoint: tf.train.Checkpoint, world: World, resume: bool, say: Callable[[str], None]
) -> TrainingState:
    """Rank 0's state to start from (resumed from the last checkpoint, or fresh), its run folder made ready; it
    reaches every rank when World.run syncs the state."""
    training = TrainingState()
    if world.is_root:
        _prepare_run_dir(run_dir, resume, say)
        if resume:
            restored = _restore(run_dir, checkpoint)
            say(f"resuming after epoch {restored.epoch}" if restored else "no checkpoint found: starting from epoch 0")
            training = restored or training
    return training


def _model_card(architecture: str, data: PreparedData) -> ModelCard:
    """The card of a model trained on `data`: the prepared set's effective settings, whatever the config said."""
    manifest = data.manifest
    return ModelCard(
        labels=manifest.labels,
        image_size=manifest.image_size,
        task=manifest.task,
        model=architecture,
        preprocessing=PREPROCESSING_VERSION,
        harmonise=manifest.harmonise,
        dataset_id=data.dataset_id,
    )


def _train_checked(config: Config, world: World, data: PreparedData, resume: bool, say: Callable[[str], None]) -> dict:
    """`train` once the shards are verified and rank 0 holds the run folder."""
    cfg, run_dir, manifest = config.train, Path(config.train.run_dir), data.manifest
    if manifest.splits["train"].records == 0 or manifest.splits["val"].records == 0:
        raise UserError(f"{data.path / MANIFEST}: train and val splits must both be non-empty")

    model, optimizer, by_source = _compiled_model(cfg, manifest, world)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    state = world.make_state(model, optimizer, _starting_state(run_dir, checkpoint, world, resume, say))
    weights = (
        class_weights(manifest.splits["train"].classes, manifest.labels, cfg.class_weight_power)
        if cfg.class_weights
        else None
    )
    fit = Fit(config, world, data, model, optimizer, checkpoint, _model_card(cfg.model, data), by_source, weights, say)
    log = world.run(fit.attempt, state)
    if world.is_root:
        write_json(run_dir / TRAIN_LOG, log)
        if log["best"].get(PREDICTED_CLASSES) == 1:
            say(
                f"warning: the saved model (epoch {log['best']['epoch']}) predicts one class for every validation image; "
                "it has not learned to tell the classes apart (see docs/training.md, 'A constant predictor')"
            )
    return log


@dataclass(frozen=True)
class Fit:
    """What every attempt of a run shares, built once before the first; an elastic job calls `attempt` again after
    a membership change, with the world's new size and rank and the state as last committed."""

    config: Config
    world: World
    data: PreparedData
    model: tf.keras.Model
    optimizer: Any
    checkpoint: tf.train.Checkpoint
    card: ModelCard
    by_source: Any  # what the training stream must know of sources, or None
    class_weights: dict[int, float] | None
    say: Callable[[str], None]

    def attempt(self, state) -> dict:
        """One `fit` with the current world: its datasets, callbacks and the epochs still to run."""
        cfg, world = self.config.train, self.world
        steps_per_epoch = max(1, self.data.manifest.splits["train"].records // (cfg.batch_size * world.size))
        every_split = InputSpec(  # the reading every split shares; each split adds its own
            image_size=self.data.manifest.image_size,
            num_classes=len(self.data.manifest.labels),
            batch_size=cfg.batch_size,
            rank=world.rank,
            size=world.size,
            threads=world.cores_per_rank,
        )
        train_ds, my_shards = make_dataset(
            self.data.shards("train"), replace(every_split.training_stream(cfg), by_source=self.by_source)
        )
        header = self.header(steps_per_epoch, my_shards)
        recorder = self.root_recorder(state)
        peak_lr = cfg.learning_rate * world.size  # LearningRateSchedule sets every step's LR
        callbacks = [
            LearningRateSchedule(peak_lr, cfg.warmup_epochs, cfg.epochs, steps_per_epoch, cfg.lr_schedule),
            EndOfEpoch(
                world,
                state,
                val_ds=make_dataset(self.data.shards("val"), every_split)[0],
                recalibration=self.recalibration(state, every_split),
                patience=cfg.early_stopping_patience,
                header=header,
                images_per_epoch=steps_per_epoch * cfg.batch_size,
                say=self.say,
                recorder=recorder,
            ),
        ]
        try:
            self.fit_remaining_epochs(state, train_ds, steps_per_epoch, peak_lr, callbacks)
        finally:
            if recorder:
                recorder.close()
        return self.log(state, header)

    def header(self, steps_per_epoch: int, my_shards) -> dict:
        """The train log's description of this attempt's world: every rank's host and shards."""
        world = self.world
        ranks = world.allgather_object(
            {
                "rank": world.rank,
                "host": world.hostname,
                "shards": [Path(f).name for f in my_shards.files],
                "record_level_sharding": my_shards.record_level,
            }
        )
        return {
            "world_size": world.size,
            "elastic": world.elastic,
            "steps_per_epoch": steps_per_epoch,
            "ranks": ranks,
            "horovod": world.tuning.record(),
        }

    def recalibration(self, state, every_split: InputSpec):
        """(training images, batches per rank) to re-estimate BatchNorm statistics with after each epoch, or None;
        with frozen BatchNorm they are measured once, before the first epoch, and then fixed."""
        cfg = self.config.train
        if not cfg.bn_recalibration_images:
            return None
        calibration_ds, _ = make_dataset(
            self.data.shards("train"),
            replace(every_split, training=True, shuffle_buffer=cfg.shuffle_buffer, seed=cfg.seed + 1),
        )
        batches = batches_per_rank(cfg.bn_recalibration_images, cfg.batch_size, self.world.size)
        if not cfg.freeze_batchnorm:
            return calibration_ds, batches
        if state.training.epoch == 0:
            self.say(f"measuring the frozen BN statistics on {cfg.bn_recalibration_images} training images")
            recompute_statistics(self.model, calibration_ds.take(batches), self.world)
        return None

    def root_recorder(self, state) -> RunRecorder | None:
        """Rank 0's run folder and its recorder (None on other ranks): possibly a new rank 0 on another board, whose
        run dir is still empty; its TensorBoard writer also writes committed epochs its event files lack (resumed,
        or a new rank 0)."""
        cfg, run_dir = self.config.train, Path(self.config.train.run_dir)
        if not self.world.is_root:
            return None
        run_dir.mkdir(parents=True, exist_ok=True)
        self.config.save(run_dir / CONFIG_FILE)
        board = (
            EpochBoard(run_dir / TENSORBOARD_DIR, self.data.manifest.labels, state.training.history)
            if cfg.tensorboard
            else None
        )
        return RunRecorder(run_dir, self.checkpoint, self.card, board)

    def fit_remaining_epochs(self, state, train_ds, steps_per_epoch: int, peak_lr: float, callbacks: list) -> None:
        cfg, world = self.config.train, self.world
        start = state.training  # as last committed: resumed, or rolled back after a lost worker
        if start.epoch >= cfg.epochs or start.stopped_early(cfg.early_stopping_patience):
            return
        self.say(
            f"training {cfg.model} on {self.data.manifest.splits['train'].records} images, {world.size} rank(s), "
            f"{steps_per_epoch} steps/epoch, lr {peak_lr:g}, from epoch {start.epoch + 1} of {cfg.epochs}"
        )
        self.model.fit(
            train_ds,
            epochs=cfg.epochs,
            initial_epoch=start.epoch,
            steps_per_epoch=steps_per_epoch,
            class_weight=None if class_weights_in_stream(cfg) else self.class_weights,
            callbacks=callbacks,
            verbose=1 if world.is_root and os.isatty(1) else 0,
        )

    def log(self, state, header: dict) -> dict:
        end = state.training
        return {
            **header,
            "epochs": end.history,
            "best": end.best,
            "collapsed_epochs": end.collapsed_epochs(),
            "optimizer_steps": int(self.optimizer.iterations.numpy()),
            # Proof that data parallelism kept the replicas identical: every rank's weight digest.
            "weights_sha256_per_rank": self.world.allgather_object(weights_digest(self.model)),
        }


def weights_digest(model: tf.keras.Model) -> str:
    digest = hashlib.sha256()
    for weight in model.get_weights():
        digest.update(np.ascontiguousarray(weight).tobytes())
    return digest.hexdigest()
