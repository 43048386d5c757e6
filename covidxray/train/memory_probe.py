"""Peak memory of one training rank, measured: what `covidxray doctor --data-dir` reports as "fits this board".

A short real run rather than a model of the parts, because most of a rank's
memory is not in the parts one would add up (weights, activations, Horovod's
fusion buffer) but in TensorFlow's runtime, oneDNN/XNNPACK scratch space and
the allocator's retained pages, which differ between x86-64 and a Pi's
aarch64 build. So on the board itself, in a child process (TensorFlow's
memory is returned only at exit):

- the config's model, optimizer and batch size, at the data's image size,
  fed by the real input pipeline (shuffle buffer, decode threads, augmentation)
  from the prepared shards;
- Horovod initialised with the config's fusion buffer and cycle time, and each
  step's gradients averaged by `grouped_allreduce` with the config's
  compression, the collective `DistributedOptimizer` runs in a job (alone
  here, so Gloo's ring buffers of a multi-board job are not counted; they hold
  about one gradient, see docs/training.md);
- peak resident memory (VmHWM) after `steps` training steps and `steps`
  validation batches (each epoch of training ends with predictions).

    python -m covidxray.train.memory_probe --data-dir data/chest3 --config configs/pi-cluster.yaml
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from covidxray.manifest import PreparedData, open_prepared

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def peak_rss_mb() -> float:
    """Peak resident set of this process so far (Linux VmHWM), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def probe(config_path: str | None, data_dir: Path, steps: int) -> dict:
    from covidxray.config import load_config
    from covidxray.train.distributed import HorovodTuning, configure_threads, standalone_gradient_averager
    from covidxray.train.finetune import hold_fixed
    from covidxray.train.input import InputSpec, make_dataset
    from covidxray.train.models import build_model

    cfg = load_config(config_path).train
    data = open_prepared(data_dir)
    labels, image_size = data.manifest.labels, data.manifest.image_size
    tuning = HorovodTuning(cfg.gradient_compression, cfg.fusion_buffer_mb, cfg.cycle_time_ms)
    configure_threads(1)
    average = standalone_gradient_averager(tuning)
    model = build_model(cfg.model, image_size, len(labels), cfg.weights)
    hold_fixed(model, cfg)

    every_split = InputSpec(image_size, len(labels), cfg.batch_size)
    train_shards = present_shards(data, "train")
    if not train_shards:
        raise SystemExit(f"no train shard of {data_dir / 'manifest.json'} on this board")
    training = every_split.training_stream(cfg)
    train_steps(model, cfg.learning_rate, average, make_dataset(train_shards, training)[0].take(steps))
    # each epoch ends with predictions on the val split (a second graph)
    validation, _ = make_dataset(present_shards(data, "val") or train_shards, every_split)
    for images, _ in validation.take(steps):
        model.predict_on_batch(images)
    return {
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "model": cfg.model,
        "image_size": image_size,
        "batch_size": cfg.batch_size,
        "steps": steps,
        "horovod": tuning.record() if average is not None else None,
    }


def present_shards(data: PreparedData, split: str) -> list[Path]:
    """The shards of `split` on this board: a board may hold only its ranks' shards."""
    return [path for path in data.shards(split) if path.is_file()]


def train_steps(model, learning_rate: float, average, batches) -> None:
    """A training step per batch as a rank takes it: Adam, and the gradients averaged when Horovod is there."""
    import tensorflow as tf

    optimizer = tf.keras.optimizers.Adam(learning_rate)
    loss_fn = tf.keras.losses.CategoricalCrossentropy()

    @tf.function
    def step(images, one_hot):
        with tf.GradientTape() as tape:
            loss = loss_fn(one_hot, model(images, training=True))
        gradients = tape.gradient(loss, model.trainable_variables)
        if average is not None:
            gradients = average(gradients)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    for images, one_hot in batches:
        step(images, one_hot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--config", default=None)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(probe(args.config, args.data_dir, args.steps)))


if __name__ == "__main__":
    main()
