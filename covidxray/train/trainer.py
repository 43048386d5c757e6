"""`covidxray train`: Keras fit over the shards, single process or one Horovod rank of many.

Only rank 0 touches the run folder. Every write there is atomic (temp file or
folder, then rename), and `checkpoints/latest.json` is the commit point: it
names a complete checkpoint folder, so a run killed at any instant resumes
from the last finished epoch with its optimizer state (`--resume`).

What rank 0 would need to carry on (epoch, history, best score, early-stopping
count) is replicated state on every rank, so that in an elastic job any
survivor can take over as rank 0 with the full history.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tensorflow as tf

from covidxray.config import Config
from covidxray.edge.preprocess import PREPROCESSING_VERSION
from covidxray.errors import UserError
from covidxray.files import PARTIAL
from covidxray.manifest import load_manifest, manifest_sha256, shard_paths
from covidxray.run_folder import (
    CHECKPOINTS,
    CONFIG_FILE,
    LATEST,
    MODEL_CARD,
    MODEL_FILE,
    TRAIN_LOG,
    read_latest,
    write_json,
    write_latest,
)
from covidxray.train.batchnorm import RecomputeBatchNorm, batches_per_rank
from covidxray.train.distributed import CommitEpoch, HorovodTuning, World, check_launch_mode, init_world
from covidxray.train.input import make_dataset
from covidxray.train.metrics import cross_entropy, macro_auc
from covidxray.train.models import build_model
from covidxray.train.run_guard import check_before_training
from covidxray.train.schedule import LearningRateSchedule

KEEP_CHECKPOINTS = 2
MONITOR = "val_auc"  # macro one-vs-rest ROC AUC on the validation split
PREDICTED_CLASSES = "val_predicted_classes"  # distinct argmax classes on val; 1 = a constant predictor


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


class Validation(tf.keras.callbacks.Callback):
    """Validation metrics from every rank's slice of the val split, gathered into one exact set.

    Each rank predicts only its share, so validation costs 1/size of the
    split per rank; the gathered predictions give the true AUC of the whole
    split (an average of per-rank AUCs would not be), identical on all ranks.
    """

    def __init__(self, world: World, dataset: tf.data.Dataset):
        super().__init__()
        self.world, self.dataset = world, dataset

    def on_epoch_end(self, epoch, logs=None):
        probabilities, labels = [], []
        for images, one_hot in self.dataset:
            probabilities.append(self.model.predict_on_batch(images))
            labels.append(np.argmax(one_hot, axis=1))
        mine = (np.concatenate(probabilities) if probabilities else np.zeros((0, self.model.output_shape[-1]), np.float32),
                np.concatenate(labels) if labels else np.zeros(0, np.int64))
        gathered = self.world.allgather_object(mine)
        probs = np.concatenate([p for p, _ in gathered])
        truth = np.concatenate([t for _, t in gathered])
        auc = macro_auc(truth, probs)
        logs.update({
            "val_loss": cross_entropy(truth, probs),
            "val_accuracy": float((probs.argmax(1) == truth).mean()),
            MONITOR: float("nan") if auc is None else auc,
            PREDICTED_CLASSES: len(np.unique(probs.argmax(1))),
        })


class EpochLog(tf.keras.callbacks.Callback):
    """Per-epoch metrics plus every rank's training throughput, so a slow board shows up."""

    def __init__(self, world: World, state, images_per_epoch: int, header: dict, run_dir: Path, say: Callable[[str], None]):
        super().__init__()
        self.world, self.state, self.images, self.header, self.run_dir, self.say = world, state, images_per_epoch, header, run_dir, say
        self.started = self.last_batch_end = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self.started = self.last_batch_end = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.last_batch_end = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = max(self.last_batch_end - self.started, 1e-6)
        rates = self.world.allgather_object(round(self.images / seconds, 1))
        lr = float(tf.keras.backend.get_value(self.model.optimizer.learning_rate))
        entry = {"epoch": epoch + 1, "seconds": round(seconds, 2), "lr": lr, "world_size": self.world.size,
                 "steps": self.header["steps_per_epoch"], "images_per_s_per_rank": rates, **clean_metrics(logs)}
        self.state.history = self.state.history + [entry]  # replaced, not mutated: an elastic rollback restores the old list
        if not self.world.is_root:
            return
        write_json(self.run_dir / TRAIN_LOG, {**self.header, "epochs": self.state.history})
        slowest = int(np.argmin(rates))
        if entry.get(PREDICTED_CLASSES) == 1:
            self.say(collapse_warning(epoch + 1))
        self.say(
            f"epoch {epoch + 1}: loss {entry.get('loss') or 0:.4f} val_auc {entry.get(MONITOR) or 0:.4f} "
            f"val_accuracy {entry.get('val_accuracy') or 0:.4f} | {sum(rates):.0f} img/s total, "
            f"slowest rank {slowest} at {rates[slowest]:.0f} img/s"
        )


class BestTracker(tf.keras.callbacks.Callback):
    """Best val AUC so far and early stopping; the same decision on every rank because val metrics are gathered."""

    def __init__(self, state, patience: int):
        super().__init__()
        self.state, self.patience = state, patience

    def on_epoch_end(self, epoch, logs=None):
        score = float(logs.get(MONITOR, float("nan")))
        best = self.state.best.get(MONITOR)
        if score > (-math.inf if best is None else best):  # NaN (undefined AUC) is never an improvement
            self.state.best = {"epoch": epoch + 1, **clean_metrics(logs)}
            self.state.epochs_since_best = 0
        else:
            self.state.epochs_since_best += 1
        if stopped_early(self.state, self.patience):
            self.model.stop_training = True


def collapse_warning(epoch: int) -> str:
    return (f"warning: after epoch {epoch} every validation image is predicted as the same class: the model is a "
            "constant predictor so far (see docs/training.md, 'A constant predictor')")


def collapsed_epochs(history: list[dict]) -> list[int]:
    return [entry["epoch"] for entry in history if entry.get(PREDICTED_CLASSES) == 1]


def stopped_early(state, patience: int) -> bool:
    return patience > 0 and state.epochs_since_best >= patience


class Checkpointer(tf.keras.callbacks.Callback):
    """Rank 0: per-epoch resumable checkpoint (model + optimizer) and the best model by val AUC.

    Folder names are unique, so the folder latest.json names is never
    rewritten in place (an elastic job may redo an epoch it had saved).
    """

    def __init__(self, run_dir: Path, checkpoint: tf.train.Checkpoint, state, card: dict):
        super().__init__()
        self.run_dir, self.checkpoint, self.state, self.card = run_dir, checkpoint, state, card

    def on_epoch_end(self, epoch, logs=None):
        root = self.run_dir / CHECKPOINTS
        root.mkdir(parents=True, exist_ok=True)
        name = f"epoch-{epoch + 1:04d}-{secrets.token_hex(4)}"
        tmp = root / f".{name}{PARTIAL}"
        self.checkpoint.write(str(tmp / "ckpt"))
        os.replace(tmp, root / name)
        if self.state.best.get("epoch") == epoch + 1:
            self._save_best_model()
        write_latest(self.run_dir, {
            "epoch": epoch + 1, "path": name, "best": self.state.best, "epochs_since_best": self.state.epochs_since_best,
            "optimizer_steps": int(self.model.optimizer.iterations.numpy()),
        })
        older = [p for p in sorted(root.glob("epoch-*")) if p.name != name]
        for old in older[: max(0, len(older) - (KEEP_CHECKPOINTS - 1))]:
            shutil.rmtree(old, ignore_errors=True)

    def _save_best_model(self) -> None:
        model_tmp = self.run_dir / (PARTIAL + "." + MODEL_FILE)
        inference_copy = tf.keras.models.clone_model(self.model)  # uncompiled: no (Horovod) optimizer inside
        inference_copy.set_weights(self.model.get_weights())
        inference_copy.save(str(model_tmp))
        os.replace(model_tmp, self.run_dir / MODEL_FILE)
        write_json(self.run_dir / MODEL_CARD, {**self.card, "best": self.state.best})


def _restore(run_dir: Path, checkpoint: tf.train.Checkpoint) -> dict:
    """State values of the last complete checkpoint (model and optimizer are restored in place); {} if none."""
    saved = read_latest(run_dir)
    if saved is None:
        return {}
    try:
        checkpoint.read(str(run_dir / CHECKPOINTS / saved["path"] / "ckpt")).assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.OpError) as err:
        raise UserError(f"{run_dir / CHECKPOINTS / LATEST}: checkpoint {saved['path']} does not fit this model/config ({err}); resume with the config it was trained with") from None
    log_path = run_dir / TRAIN_LOG
    try:
        history = json.loads(log_path.read_text()).get("epochs", []) if log_path.is_file() else []
    except (ValueError, AttributeError):  # a damaged log only loses the per-epoch history of a run whose weights are intact
        history = []
    return {
        "epoch": int(saved["epoch"]),
        "history": [e for e in history if e["epoch"] <= saved["epoch"]],
        "best": saved.get("best", {}),
        "epochs_since_best": int(saved.get("epochs_since_best", 0)),
    }


def _prepare_run_dir(run_dir: Path, resume: bool, say: Callable[[str], None]) -> None:
    """Rank 0: drop half-written leftovers; without --resume, also the previous run's checkpoints."""
    checkpoints = run_dir / CHECKPOINTS
    for leftover in [*run_dir.glob(f"*{PARTIAL}*"), *checkpoints.glob(f".*{PARTIAL}")]:
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    if not resume and checkpoints.exists():
        say(f"starting over in {run_dir}: removing the previous run's checkpoints (use --resume to continue it)")
        shutil.rmtree(checkpoints)
    run_dir.mkdir(parents=True, exist_ok=True)


def train(config: Config, resume: bool = False, say: Callable[[str], None] = print, force: bool = False) -> dict:
    cfg, data_dir = config.train, Path(config.data.data_dir)
    check_launch_mode(cfg.elastic)
    world = init_world(HorovodTuning(cfg.gradient_compression, cfg.fusion_buffer_mb, cfg.cycle_time_ms))
    user_say = say

    def say(message: str) -> None:  # asked at each call: an elastic job may hand rank 0 to another worker
        if world.is_root:
            user_say(message)

    run_dir = Path(cfg.run_dir)
    manifest = load_manifest(data_dir)
    check_before_training(world, config, data_dir, manifest, resume, force, say)
    labels, image_size = manifest["labels"], int(manifest["image_size"])
    config.data.image_size, config.data.task = image_size, manifest["task"]
    train_records = manifest["splits"]["train"]["records"]
    if train_records == 0 or manifest["splits"]["val"]["records"] == 0:
        raise UserError(f"{data_dir / 'manifest.json'}: train and val splits must both be non-empty")

    tf.keras.utils.set_random_seed(cfg.seed)
    model = build_model(cfg.model, image_size, len(labels), cfg.weights)
    optimizer = world.distributed_optimizer(tf.keras.optimizers.Adam(cfg.learning_rate))
    loss = tf.keras.losses.CategoricalCrossentropy(label_smoothing=cfg.label_smoothing)
    model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
    optimizer.build(model.trainable_variables)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)

    values = {"epoch": 0, "history": [], "best": {}, "epochs_since_best": 0}
    if world.is_root:
        _prepare_run_dir(run_dir, resume, say)
        if resume:
            restored = _restore(run_dir, checkpoint)
            say(f"resuming after epoch {restored['epoch']}" if restored else "no checkpoint found: starting from epoch 0")
            values.update(restored)
    state = world.make_state(model, optimizer, **values)
    card = {
        "labels": labels, "image_size": image_size, "task": manifest["task"], "model": cfg.model,
        "preprocessing": PREPROCESSING_VERSION, "manifest_sha256": manifest_sha256(data_dir),
    }
    weights = class_weights(manifest["splits"]["train"]["classes"], labels, cfg.class_weight_power) if cfg.class_weights else None

    def attempt(state) -> dict:
        """One `fit` with the current world; elastic jobs call it again after a membership change."""
        steps_per_epoch = max(1, train_records // (cfg.batch_size * world.size))
        data_args = dict(image_size=image_size, num_classes=len(labels), batch_size=cfg.batch_size, rank=world.rank, size=world.size, threads=world.cores_per_rank)
        train_ds, my_shards = make_dataset(shard_paths(data_dir, "train"), training=True, augment=cfg.augment, shuffle_buffer=cfg.shuffle_buffer, seed=cfg.seed, **data_args)
        val_ds, _ = make_dataset(shard_paths(data_dir, "val"), **data_args)
        scaled_lr = cfg.learning_rate * world.size  # the peak; LearningRateSchedule sets every step's LR
        ranks = world.allgather_object({"rank": world.rank, "host": world.hostname, "shards": [Path(f).name for f in my_shards.files], "record_level_sharding": my_shards.record_level})
        header = {"world_size": world.size, "elastic": world.elastic, "steps_per_epoch": steps_per_epoch, "ranks": ranks, "horovod": world.tuning.record()}
        callbacks = [LearningRateSchedule(scaled_lr, cfg.warmup_epochs, cfg.epochs, steps_per_epoch, cfg.lr_schedule)]
        if cfg.bn_recalibration_images:  # before Validation: val and the saved model use the re-estimated statistics
            calibration_ds, _ = make_dataset(shard_paths(data_dir, "train"), training=True, shuffle_buffer=cfg.shuffle_buffer, seed=cfg.seed + 1, **data_args)
            callbacks.append(RecomputeBatchNorm(world, calibration_ds, batches_per_rank(cfg.bn_recalibration_images, cfg.batch_size, world.size)))
        callbacks += [
            Validation(world, val_ds),
            *world.callbacks(),
            EpochLog(world, state, steps_per_epoch * cfg.batch_size, header, run_dir, say),
            BestTracker(state, cfg.early_stopping_patience),
        ]
        if world.is_root:  # possibly a new rank 0 on another board, whose run dir is still empty
            run_dir.mkdir(parents=True, exist_ok=True)
            config.save(run_dir / CONFIG_FILE)
            callbacks.append(Checkpointer(run_dir, checkpoint, state, card))
        callbacks.append(CommitEpoch(state))
        if state.epoch < cfg.epochs and not stopped_early(state, cfg.early_stopping_patience):
            say(f"training {cfg.model} on {train_records} images, {world.size} rank(s), {steps_per_epoch} steps/epoch, "
                f"lr {scaled_lr:g}, from epoch {state.epoch + 1} of {cfg.epochs}")
            model.fit(
                train_ds, epochs=cfg.epochs, initial_epoch=state.epoch, steps_per_epoch=steps_per_epoch,
                class_weight=weights, callbacks=callbacks, verbose=1 if world.is_root and os.isatty(1) else 0,
            )
        # Proof that data parallelism kept the replicas identical: every rank's weight digest.
        return {**header, "epochs": state.history, "best": state.best, "collapsed_epochs": collapsed_epochs(state.history),
                "optimizer_steps": int(optimizer.iterations.numpy()), "weights_sha256_per_rank": world.allgather_object(weights_digest(model))}

    log = world.run(attempt, state)
    if world.is_root:
        write_json(run_dir / TRAIN_LOG, log)
        if log["best"].get(PREDICTED_CLASSES) == 1:
            say(f"warning: the saved model (epoch {log['best']['epoch']}) predicts one class for every validation image; "
                "it has not learned to tell the classes apart (see docs/training.md, 'A constant predictor')")
    return log


def weights_digest(model: tf.keras.Model) -> str:
    digest = hashlib.sha256()
    for weight in model.get_weights():
        digest.update(np.ascontiguousarray(weight).tobytes())
    return digest.hexdigest()
