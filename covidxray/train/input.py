"""tf.data input over the prepared shards.

Each rank reads a disjoint set of shard files; with fewer files than ranks
every rank reads all files in the same order and keeps every size-th record.
Memory stays bounded, which is what lets a 4 GB board train on a large set:

- nothing is cached, and shuffling happens on the encoded records (PNG bytes,
  a few kB each) before decoding, so the shuffle buffer holds
  `shuffle_buffer` compressed images, not decoded float tensors;
- decoding and augmentation run `threads` images at a time and at most
  PREFETCH_BATCHES decoded batches wait for the model.

Decoded images in flight: about (threads + PREFETCH_BATCHES + 1) x batch x
size^2 x 4 bytes, e.g. 45 MB at 224 px, batch 32, 4 threads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tensorflow as tf

from covidxray.data.tfrecord import parse_example

PREFETCH_BATCHES = 2


@dataclass(frozen=True)
class RankShards:
    files: list[str]
    record_level: bool  # True when every rank reads all files and keeps every size-th record


def assign_shards(paths: list[Path], rank: int, size: int) -> RankShards:
    files = sorted(str(p) for p in paths)
    if len(files) >= size:
        return RankShards(files[rank::size], record_level=False)
    return RankShards(files, record_level=True)


def rank_records(shards: RankShards, rank: int, size: int, training: bool, seed: int) -> tf.data.Dataset:
    """Serialized examples this rank owns, before any decoding.

    Record-level sharding only splits the stream disjointly when every rank
    sees the same stream, so then the file order is shuffled with a seed
    shared by all ranks and read deterministically.
    """
    files = tf.data.Dataset.from_tensor_slices(shards.files)
    if training:
        file_seed = seed if shards.record_level else seed + rank
        files = files.shuffle(len(shards.files), seed=file_seed, reshuffle_each_iteration=True)
    deterministic = shards.record_level or not training
    cycle = min(4, len(shards.files))
    records = files.interleave(
        tf.data.TFRecordDataset, cycle_length=cycle, num_parallel_calls=cycle, deterministic=deterministic
    )
    return records.shard(size, rank) if shards.record_level else records


def _augmenter(strength: float = 1.0):
    """Small affine and brightness/contrast changes; `strength` scales every range (1: the ranges below, 2: twice them).

    The ranges are the variation between radiographs of one kind: framing (scale, shift), patient rotation,
    exposure. Larger ones teach a model not to lean on a source's framing or exposure, at the cost of slower fitting.
    """
    # albumentations asks PyPI for a newer version on import: every rank of every run would contact the
    # internet from a hospital network, or warn after a 2 s timeout on an air-gapped cluster.
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    import albumentations as A

    return A.Compose(
        [
            A.Affine(
                scale=(1 - 0.08 * strength, 1 + 0.08 * strength),
                translate_percent=(-0.04 * strength, 0.04 * strength),
                rotate=(-7 * strength, 7 * strength),
                border_mode=0,
                p=0.9,
            ),
            A.RandomBrightnessContrast(brightness_limit=0.12 * strength, contrast_limit=0.12 * strength, p=0.8),
        ]
    )


def _augment_fn(strength: float):
    augmenter = _augmenter(strength)

    def augment(image: np.ndarray) -> np.ndarray:
        out = augmenter(image=image.astype(np.uint8))["image"]
        return out.astype(np.float32).reshape(image.shape)

    return augment


def make_dataset(
    paths: list[Path],
    image_size: int,
    num_classes: int,
    batch_size: int,
    rank: int = 0,
    size: int = 1,
    training: bool = False,
    augment: bool = False,
    augment_strength: float = 1.0,
    shuffle_buffer: int = 512,
    seed: int = 0,
    threads: int = 0,
) -> tuple[tf.data.Dataset, RankShards]:
    """Batches of (float32 gray 0..255 [size, size, 1], one-hot label) for this rank.

    Training: endless, shuffled, optionally augmented. Otherwise: one ordered
    pass (rank 0 of 1 reads the whole split). `threads` (0: TF decides) caps
    the decode parallelism and tf.data's thread pool for this rank.
    """
    shards = assign_shards(paths, rank, size)
    records = rank_records(shards, rank, size, training, seed)
    if training:
        records = records.repeat().shuffle(shuffle_buffer, seed=seed + rank)
    parallel = threads or tf.data.AUTOTUNE
    ds = records.map(lambda s: parse_example(s, image_size), num_parallel_calls=parallel, deterministic=not training)
    if training and augment:
        augment_fn = _augment_fn(augment_strength)

        def apply(image, label):
            out = tf.numpy_function(augment_fn, [image], tf.float32, stateful=True)
            return tf.ensure_shape(out, [image_size, image_size, 1]), label

        ds = ds.map(apply, num_parallel_calls=parallel, deterministic=False)
    ds = ds.map(lambda image, label: (image, tf.one_hot(label, num_classes)))
    ds = ds.batch(batch_size).prefetch(PREFETCH_BATCHES)
    if threads:
        options = tf.data.Options()
        options.threading.private_threadpool_size = threads
        ds = ds.with_options(options)
    return ds, shards


def predict_batches(model: tf.keras.Model, dataset: tf.data.Dataset, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(probabilities, true class indices) of one pass over batches of (image, one-hot label); empty arrays for none."""
    probabilities, labels = [], []
    for images, one_hot in dataset:
        probabilities.append(model.predict_on_batch(images))
        labels.append(np.argmax(one_hot, axis=1))
    if not probabilities:
        return np.zeros((0, num_classes), np.float32), np.zeros(0, np.int64)
    return np.concatenate(probabilities), np.concatenate(labels)
