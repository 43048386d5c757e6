"""tf.data input over the prepared shards.

Each rank reads a disjoint set of shard files; with fewer shards than ranks it
falls back to reading every file and keeping every size-th record. Memory stays
bounded (no cache of the training set, a fixed shuffle buffer and prefetch),
which is what lets a 4 GB board train on a large set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tensorflow as tf

from covidxray.data.tfrecord import parse_example


@dataclass(frozen=True)
class RankShards:
    files: list[str]
    record_level: bool  # True when every rank reads all files and keeps every size-th record


def assign_shards(paths: list[Path], rank: int, size: int) -> RankShards:
    files = sorted(str(p) for p in paths)
    if len(files) >= size:
        return RankShards(files[rank::size], record_level=False)
    return RankShards(files, record_level=True)


def _augmenter():
    import albumentations as A

    return A.Compose(
        [
            A.Affine(scale=(0.92, 1.08), translate_percent=(-0.04, 0.04), rotate=(-7, 7), border_mode=0, p=0.9),
            A.RandomBrightnessContrast(brightness_limit=0.12, contrast_limit=0.12, p=0.8),
        ]
    )


def _augment_fn():
    augmenter = _augmenter()

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
    shuffle_buffer: int = 512,
    seed: int = 0,
) -> tuple[tf.data.Dataset, RankShards]:
    shards = assign_shards(paths, rank, size) if training else RankShards(sorted(map(str, paths)), False)
    files = tf.data.Dataset.from_tensor_slices(shards.files)
    if training:
        files = files.shuffle(len(shards.files), seed=seed + rank, reshuffle_each_iteration=True)
    ds = files.interleave(tf.data.TFRecordDataset, cycle_length=min(4, len(shards.files)), num_parallel_calls=tf.data.AUTOTUNE, deterministic=not training)
    if shards.record_level:
        ds = ds.shard(size, rank)
    ds = ds.map(lambda s: parse_example(s, image_size), num_parallel_calls=tf.data.AUTOTUNE)
    if training:
        ds = ds.repeat().shuffle(shuffle_buffer, seed=seed + rank)
        if augment:
            augment_fn = _augment_fn()

            def apply(image, label):
                out = tf.numpy_function(augment_fn, [image], tf.float32, stateful=True)
                return tf.ensure_shape(out, [image_size, image_size, 1]), label

            ds = ds.map(apply, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.map(lambda image, label: (image, tf.one_hot(label, num_classes)), num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE), shards
