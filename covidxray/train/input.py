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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

from covidxray.data.tfrecord import FEATURES, parse_example

if TYPE_CHECKING:
    from covidxray.config import TrainConfig

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


def _augmenter(strength: float = 1.0, degrade: float = 0.0):
    """Small affine and brightness/contrast changes; `strength` scales every range (1: the ranges below, 2: twice them).

    The ranges are the variation between radiographs of one kind: framing (scale, shift), patient rotation,
    exposure. Larger ones teach a model not to lean on a source's framing or exposure, at the cost of slower fitting.
    `degrade` (train.degrade) is the probability of each degradation a collection's encoding differs by: a lower
    resolution (downscaled to 35-90% and back), JPEG at quality 25-90, sensor noise (sigma up to 3% of full
    scale), so that how a collection stored its films stops telling the collections apart (issue 24).
    """
    # albumentations asks PyPI for a newer version on import: every rank of every run would contact the
    # internet from a hospital network, or warn after a 2 s timeout on an air-gapped cluster.
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    import albumentations as A

    degradations = (
        [
            A.Downscale(scale_range=(0.35, 0.9), p=degrade),
            A.ImageCompression(compression_type="jpeg", quality_range=(25, 90), p=degrade),
            A.GaussNoise(std_range=(0.0, 0.03), p=degrade),
        ]
        if degrade
        else []
    )
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
            *degradations,
        ]
    )


def _augment_fn(strength: float, degrade: float = 0.0):
    augmenter = _augmenter(strength, degrade)

    def augment(image: np.ndarray) -> np.ndarray:
        out = augmenter(image=image.astype(np.uint8))["image"]
        return out.astype(np.float32).reshape(image.shape)

    return augment


@dataclass(frozen=True)
class InputSpec:
    """How one split is read into batches: what the model takes, this rank's share, and the training stream.

    `threads` (0: TF decides) caps the decode parallelism and tf.data's thread pool for this rank. Training
    (`training`): endless, shuffled (`shuffle_buffer` encoded records, `seed`), optionally augmented (`augment`,
    `augment_strength`, `degrade`: see _augmenter). `by_source` (training only): each
    source's records in a stream of their own, the streams drawn in proportion to the sources' shares, so every
    batch holds every source in proportion (the shards are ordered by source), with a sample weight per (source,
    class); and/or the source index as a second input, x = {"image", "source"} (covidxray/train/source_balance.py).
    """

    image_size: int
    num_classes: int
    batch_size: int
    rank: int = 0
    size: int = 1
    threads: int = 0
    training: bool = False
    augment: bool = False
    augment_strength: float = 1.0
    degrade: float = 0.0
    shuffle_buffer: int = 512
    seed: int = 0
    by_source: SourceAware | None = None

    def training_stream(self, train: TrainConfig) -> InputSpec:
        """This reading as the training stream of `train`: endless, shuffled and augmented as it says."""
        return replace(
            self,
            training=True,
            augment=train.augment,
            augment_strength=train.augment_strength,
            shuffle_buffer=train.shuffle_buffer,
            seed=train.seed,
            degrade=train.degrade,
        )


def make_dataset(paths: list[Path], spec: InputSpec) -> tuple[tf.data.Dataset, RankShards]:
    """Batches of (float32 gray 0..255 [size, size, 1], one-hot label) of this rank's share of `paths`.

    Training: endless, shuffled, optionally augmented. Otherwise: one ordered pass (rank 0 of 1 reads the whole
    split).
    """
    shards = assign_shards(paths, spec.rank, spec.size)
    parallel = spec.threads or tf.data.AUTOTUNE
    ds = _stream(shards, spec).map(_parser(spec), num_parallel_calls=parallel, deterministic=not spec.training)
    if spec.training and spec.augment:
        ds = ds.map(_augmentation(spec), num_parallel_calls=parallel, deterministic=False)
    ds = ds.map(_labelled(spec)).batch(spec.batch_size).prefetch(PREFETCH_BATCHES)
    if spec.threads:
        options = tf.data.Options()
        options.threading.private_threadpool_size = spec.threads
        ds = ds.with_options(options)
    return ds, shards


def _stream(shards: RankShards, spec: InputSpec) -> tf.data.Dataset:
    """This rank's serialized examples: one ordered pass, or (training) an endless shuffled stream, drawn from
    one stream per source in proportion to their shares when `by_source` has them."""
    rank, size, seed = spec.rank, spec.size, spec.seed
    by_source = spec.by_source
    if spec.training and by_source is not None and by_source.shares is not None:
        streams = [
            rank_records(shards, rank, size, spec.training, seed)
            .filter(lambda serialized, name=name: _source_of(serialized) == name)
            .repeat()
            .shuffle(spec.shuffle_buffer, seed=seed + rank + index)
            for index, name in enumerate(by_source.sources)
        ]
        return tf.data.Dataset.sample_from_datasets(streams, weights=list(by_source.shares), seed=seed + rank)
    records = rank_records(shards, rank, size, spec.training, seed)
    return records.repeat().shuffle(spec.shuffle_buffer, seed=seed + rank) if spec.training else records


def _parser(spec: InputSpec):
    """Serialized example -> (image, label), or with `by_source` (image, label, source index)."""
    if spec.by_source is not None:
        return _source_parser(spec.image_size, spec.by_source)
    return lambda serialized: parse_example(serialized, spec.image_size)


def _augmentation(spec: InputSpec):
    """(image, label, ...) -> the same with the image augmented (albumentations, in a numpy function)."""
    augment_fn = _augment_fn(spec.augment_strength, spec.degrade)

    def apply(image, label, *rest):
        out = tf.numpy_function(augment_fn, [image], tf.float32, stateful=True)
        return (tf.ensure_shape(out, [spec.image_size, spec.image_size, 1]), label, *rest)

    return apply


def _labelled(spec: InputSpec):
    """(image, label[, source]) -> what `fit` takes: (x, one-hot label[, sample weight]) (source_balance.py)."""
    by_source = spec.by_source
    if by_source is not None:
        return lambda image, label, source: by_source.example(image, tf.one_hot(label, spec.num_classes), label, source)
    return lambda image, label: (image, tf.one_hot(label, spec.num_classes))


def _source_of(serialized: tf.Tensor) -> tf.Tensor:
    return tf.io.parse_single_example(serialized, {"source": FEATURES["source"]})["source"]


def _source_parser(image_size: int, by_source: SourceAware):
    """Serialized example -> (image, label, source index); a source train never had is index len(sources)."""
    table = tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(list(by_source.sources), tf.range(len(by_source.sources), dtype=tf.int64)),
        default_value=len(by_source.sources),
    )

    def parse(serialized):
        image, label = parse_example(serialized, image_size)
        return image, label, table.lookup(_source_of(serialized))

    return parse


@dataclass(frozen=True)
class SourceAware:
    """What the training stream knows of sources: their names (index = position), their shares of the train split
    (None: one shuffled stream), a sample weight per (source, class) (None: no sample weights), and whether the
    model takes the source index as a second input (the source adversary)."""

    sources: tuple[str, ...]
    shares: tuple[float, ...] | None = None
    weights: tuple[tuple[float, ...], ...] | None = None
    source_input: bool = False

    def example(self, image, one_hot, label, source):
        x = {"image": image, "source": source} if self.source_input else image
        if self.weights is None:
            return x, one_hot
        weight = tf.gather_nd(tf.constant(self.weights, tf.float32), tf.stack([source, label]))
        return x, one_hot, weight


def predict_batches(model: tf.keras.Model, dataset: tf.data.Dataset, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(probabilities, true class indices) of one pass over batches of (image, one-hot label); empty arrays for none."""
    probabilities, labels = [], []
    for images, one_hot in dataset:
        probabilities.append(model.predict_on_batch(images))
        labels.append(np.argmax(one_hot, axis=1))
    if not probabilities:
        return np.zeros((0, num_classes), np.float32), np.zeros(0, np.int64)
    return np.concatenate(probabilities), np.concatenate(labels)
