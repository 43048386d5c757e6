"""`covidxray train`: Keras fit over the shards, single process or one Horovod rank of many.

Only rank 0 touches the run folder. Every write there is atomic (temp file or
folder, then rename), so a run killed at any instant leaves the last complete
checkpoint and best model intact for `--resume`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from covidxray.config import Config
from covidxray.data.prepare import load_manifest, manifest_sha256, shard_paths
from covidxray.data.preprocess import PREPROCESSING
from covidxray.errors import UserError
from covidxray.train.distributed import World, init_world
from covidxray.train.input import make_dataset
from covidxray.train.models import build_model

MODEL_FILE = "model.keras"
MODEL_CARD = "model.json"
TRAIN_LOG = "train_log.json"
LATEST = "latest.json"
KEEP_CHECKPOINTS = 2


def write_json(path: Path, payload: Any) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, path)


def class_weights(counts: dict[str, int], labels: list[str]) -> dict[int, float]:
    """Inverse-frequency weights (mean 1 over samples) so a rare class is not ignored."""
    total = sum(counts.get(c, 0) for c in labels)
    present = [c for c in labels if counts.get(c, 0)]
    return {i: (total / (len(present) * counts[c]) if counts.get(c, 0) else 0.0) for i, c in enumerate(labels)}


class Checkpointer(tf.keras.callbacks.Callback):
    """Rank 0: per-epoch resumable checkpoint (model + optimizer) and the best model by val AUC."""

    def __init__(self, run_dir: Path, checkpoint: tf.train.Checkpoint, card: dict, monitor: str = "val_auc"):
        super().__init__()
        self.run_dir = run_dir
        self.checkpoint = checkpoint
        self.card = card
        self.monitor = monitor
        self.best = card.get("best", {}).get(monitor, -np.inf)

    def on_epoch_end(self, epoch: int, logs=None):
        logs = logs or {}
        ckpt_root = self.run_dir / "checkpoints"
        ckpt_root.mkdir(parents=True, exist_ok=True)
        final = ckpt_root / f"epoch-{epoch + 1:04d}"
        tmp = ckpt_root / f".epoch-{epoch + 1:04d}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        self.checkpoint.write(str(tmp / "ckpt"))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        score = float(logs.get(self.monitor, -np.inf))
        if score > self.best:
            self.best = score
            self.card["best"] = {"epoch": epoch + 1, **{k: float(v) for k, v in logs.items()}}
            model_tmp = self.run_dir / (".partial." + MODEL_FILE)
            inference_copy = tf.keras.models.clone_model(self.model)  # uncompiled: no (Horovod) optimizer inside
            inference_copy.set_weights(self.model.get_weights())
            inference_copy.save(str(model_tmp))
            os.replace(model_tmp, self.run_dir / MODEL_FILE)
            write_json(self.run_dir / MODEL_CARD, self.card)
        write_json(ckpt_root / LATEST, {"epoch": epoch + 1, "path": final.name, "best": self.card.get("best", {})})
        for old in sorted(ckpt_root.glob("epoch-*"))[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old, ignore_errors=True)


class EpochLog(tf.keras.callbacks.Callback):
    """Per-epoch metrics plus every rank's throughput, so a slow board shows up."""

    def __init__(self, world: World, images_per_epoch: int, log: dict, run_dir: Path, say: Callable[[str], None]):
        super().__init__()
        self.world, self.images, self.log, self.run_dir, self.say = world, images_per_epoch, log, run_dir, say
        self.started = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self.started = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self.started
        rates = self.world.allgather_object(round(self.images / seconds, 1))
        if not self.world.is_root:
            return
        lr = float(tf.keras.backend.get_value(self.model.optimizer.learning_rate))
        entry = {"epoch": epoch + 1, "seconds": round(seconds, 2), "lr": lr, "images_per_s_per_rank": rates}
        entry.update({k: float(v) for k, v in (logs or {}).items()})
        self.log["epochs"].append(entry)
        write_json(self.run_dir / TRAIN_LOG, self.log)
        slowest = int(np.argmin(rates))
        self.say(
            f"epoch {epoch + 1}: loss {entry.get('loss', 0):.4f} val_auc {entry.get('val_auc', 0):.4f} "
            f"val_accuracy {entry.get('val_accuracy', 0):.4f} | {sum(rates):.0f} img/s total, "
            f"slowest rank {slowest} at {rates[slowest]:.0f} img/s"
        )


def _restore(run_dir: Path, checkpoint: tf.train.Checkpoint) -> tuple[int, dict]:
    latest = run_dir / "checkpoints" / LATEST
    if not latest.is_file():
        return 0, {}
    state = json.loads(latest.read_text())
    checkpoint.read(str(run_dir / "checkpoints" / state["path"] / "ckpt")).expect_partial()
    return int(state["epoch"]), state.get("best", {})


def train(config: Config, resume: bool = False, say: Callable[[str], None] = print) -> dict:
    world = init_world()
    say = say if world.is_root else (lambda _msg: None)
    cfg, data_dir = config.train, Path(config.data.data_dir)
    run_dir = Path(cfg.run_dir)
    manifest = load_manifest(data_dir)
    labels, image_size = manifest["labels"], int(manifest["image_size"])
    config.data.image_size, config.data.task = image_size, manifest["task"]
    train_records = manifest["splits"]["train"]["records"]
    if train_records == 0 or manifest["splits"]["val"]["records"] == 0:
        raise UserError(f"{data_dir / 'manifest.json'}: train and val splits must both be non-empty")

    tf.keras.utils.set_random_seed(cfg.seed)
    steps_per_epoch = max(1, train_records // (cfg.batch_size * world.size))
    train_ds, my_shards = make_dataset(
        shard_paths(data_dir, "train"), image_size, len(labels), cfg.batch_size, world.rank, world.size,
        training=True, augment=cfg.augment, shuffle_buffer=cfg.shuffle_buffer, seed=cfg.seed,
    )
    val_ds, _ = make_dataset(shard_paths(data_dir, "val"), image_size, len(labels), cfg.batch_size)

    model = build_model(cfg.model, image_size, len(labels), cfg.weights)
    scaled_lr = cfg.learning_rate * world.size
    optimizer = world.distributed_optimizer(tf.keras.optimizers.Adam(scaled_lr))
    model.compile(optimizer=optimizer, loss="categorical_crossentropy", metrics=["accuracy", tf.keras.metrics.AUC(name="auc")])
    optimizer.build(model.trainable_variables)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)

    initial_epoch, best = 0, {}
    if resume and world.is_root:
        initial_epoch, best = _restore(run_dir, checkpoint)
    initial_epoch = world.broadcast_object(initial_epoch)
    if resume:
        say(f"resuming after epoch {initial_epoch}" if initial_epoch else "no checkpoint found: starting from epoch 0")

    ranks = world.allgather_object({"rank": world.rank, "host": world.hostname, "shards": [Path(f).name for f in my_shards.files], "record_level_sharding": my_shards.record_level})
    log = {"world_size": world.size, "steps_per_epoch": steps_per_epoch, "ranks": ranks, "epochs": []}
    callbacks = world.callbacks(scaled_lr, cfg.warmup_epochs, steps_per_epoch)
    callbacks.append(EpochLog(world, steps_per_epoch * cfg.batch_size, log, run_dir, say))
    if cfg.early_stopping_patience > 0:
        callbacks.append(tf.keras.callbacks.EarlyStopping("val_auc", mode="max", patience=cfg.early_stopping_patience))
    if world.is_root:
        run_dir.mkdir(parents=True, exist_ok=True)
        previous_log = run_dir / TRAIN_LOG
        if resume and previous_log.is_file():
            log["epochs"] = [e for e in json.loads(previous_log.read_text())["epochs"] if e["epoch"] <= initial_epoch]
        config.save(run_dir / "config.yaml")
        card = {
            "labels": labels, "image_size": image_size, "task": manifest["task"], "model": cfg.model,
            "preprocessing": PREPROCESSING, "manifest_sha256": manifest_sha256(data_dir), "best": best,
        }
        callbacks.append(Checkpointer(run_dir, checkpoint, card))
        say(f"training {cfg.model} on {train_records} images, {world.size} rank(s), {steps_per_epoch} steps/epoch, lr {scaled_lr:g}")

    weights = class_weights(manifest["splits"]["train"]["classes"], labels) if cfg.class_weights else None
    verbose = 1 if world.is_root and os.isatty(1) else 0  # EpochLog prints the per-epoch summary
    if initial_epoch < cfg.epochs:
        model.fit(
            train_ds, epochs=cfg.epochs, initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
            validation_data=val_ds, class_weight=weights, callbacks=callbacks, verbose=verbose,
        )
    # Proof that data parallelism kept the replicas identical: every rank's weight digest.
    log["weights_sha256_per_rank"] = world.allgather_object(weights_digest(model))
    if world.is_root:
        write_json(run_dir / TRAIN_LOG, log)
    return log


def weights_digest(model: tf.keras.Model) -> str:
    digest = hashlib.sha256()
    for weight in model.get_weights():
        digest.update(np.ascontiguousarray(weight).tobytes())
    return digest.hexdigest()
