"""TFRecord shard format: one tf.train.Example per image.

Images are stored already decoded-and-resized, as 8-bit gray PNG bytes, so the
training input pipeline only inflates PNGs (cheap on a Pi) and every rank reads
bit-identical pixels. Text features are UTF-8; a name made from a file name
that is not valid UTF-8 keeps its raw bytes (surrogateescape) both ways.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import tensorflow as tf

from covidxray.files import atomic_path

FEATURES = {
    "image": tf.io.FixedLenFeature([], tf.string),
    "label": tf.io.FixedLenFeature([], tf.int64),
    "patient_id": tf.io.FixedLenFeature([], tf.string),
    "source": tf.io.FixedLenFeature([], tf.string),
    "record_id": tf.io.FixedLenFeature([], tf.string),
}


def _bytes(value: bytes) -> tf.train.Feature:
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))


def _text(value: str) -> bytes:
    return value.encode("utf-8", "surrogateescape")


def make_example(png: bytes, label: int, patient_id: str, source: str, record_id: str) -> bytes:
    feature = {
        "image": _bytes(png),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
        "patient_id": _bytes(_text(patient_id)),
        "source": _bytes(_text(source)),
        "record_id": _bytes(_text(record_id)),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write_shard(path: Path, examples: Iterable[bytes]) -> int:
    """Write atomically: a shard either exists complete or not at all. A failed write (a full disk) is an OSError."""
    count = 0
    with atomic_path(path) as tmp:
        try:
            with tf.io.TFRecordWriter(str(tmp)) as writer:
                for example in examples:
                    writer.write(example)
                    count += 1
        except tf.errors.OpError as err:
            raise OSError(f"{tmp}: {err.message}") from None
    return count


def parse_example(serialized: tf.Tensor, image_size: int) -> tuple[tf.Tensor, tf.Tensor]:
    """Serialized Example -> (float32 [size, size, 1] gray 0..255, int64 label)."""
    parsed = tf.io.parse_single_example(serialized, FEATURES)
    image = tf.io.decode_png(parsed["image"], channels=1)
    image = tf.ensure_shape(image, [image_size, image_size, 1])
    return tf.cast(image, tf.float32), parsed["label"]


def read_records(paths: Iterable[Path]) -> Iterable[dict]:
    """Eager iteration over shards as plain dicts (tests, evaluation, export)."""
    for raw in tf.data.TFRecordDataset([str(p) for p in paths]):
        parsed = tf.io.parse_single_example(raw, FEATURES)
        yield {
            "image": tf.io.decode_png(parsed["image"], channels=1).numpy(),
            "label": int(parsed["label"]),
            "patient_id": parsed["patient_id"].numpy().decode("utf-8", "surrogateescape"),
            "source": parsed["source"].numpy().decode("utf-8", "surrogateescape"),
            "record_id": parsed["record_id"].numpy().decode("utf-8", "surrogateescape"),
        }
