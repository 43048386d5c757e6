"""Test images for the report, with Grad-CAM: the most confident errors, and the most confident correct case per class.

The predictions are evaluate's (TEST_PREDICTIONS: every test image's probabilities in shard order); the images
are read back from the test shards in that same order, and the true classes must agree one by one, else the
predictions belong to another data set and no example is shown. Without TEST_PREDICTIONS (an evaluation made
before it existed) the Keras model predicts the test split here, and the report says so. Needs TensorFlow.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

from covidxray.errors import UserError
from covidxray.manifest import PreparedData

ERRORS_SHOWN = 3


@dataclass
class Example:
    index: int  # position in the test split (shard order) = row of the predictions
    kind: str  # "error" or "correct"
    truth: int
    predicted: int
    probability: float  # of the predicted class
    original_png: bytes
    gradcam_png: bytes


def pick(labels: np.ndarray, probabilities: np.ndarray, errors: int = ERRORS_SHOWN) -> list[tuple[int, str]]:
    """(test index, kind): the `errors` wrong calls with the highest predicted probability, then per class the right
    call with the highest probability (classes without one are skipped)."""
    predicted = probabilities.argmax(1)
    confidence = probabilities.max(1)
    order = np.argsort(-confidence, kind="stable")
    wrong = [int(i) for i in order if predicted[i] != labels[i]][:errors]
    right = []
    for c in range(probabilities.shape[1]):
        hits = [int(i) for i in order if labels[i] == c and predicted[i] == c]
        right += hits[:1]
    return [(i, "error") for i in wrong] + [(i, "correct") for i in right]


def read_test_split(data: PreparedData, wanted: set[int]) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """(true class of every test record, {index: gray uint8 image} for `wanted`), in the order evaluate predicted."""
    import tensorflow as tf

    from covidxray.data.tfrecord import FEATURES
    from covidxray.train.input import assign_shards, rank_records

    records = rank_records(assign_shards(data.shards("test"), 0, 1), 0, 1, training=False, seed=0)
    labels, images = [], {}
    for index, serialized in enumerate(records):
        parsed = tf.io.parse_single_example(serialized, FEATURES)
        labels.append(int(parsed["label"]))
        if index in wanted:
            images[index] = tf.io.decode_png(parsed["image"], channels=1).numpy()[:, :, 0]
    return np.array(labels, np.int64), images


def _png(image: np.ndarray) -> bytes:
    ok, encoded = cv2.imencode(".png", image)
    if not ok:
        raise UserError("could not encode an example image as PNG")
    return encoded.tobytes()


def gradcam_examples(model, data: PreparedData, labels: np.ndarray, probabilities: np.ndarray) -> list[Example]:
    """Grad-CAM of the predicted class for each picked test image; [] when the predictions do not fit the shards."""
    from covidxray.edge.class_maps import overlay
    from covidxray.export.gradcam import heatmaps, score_function

    chosen = pick(labels, probabilities)
    shard_labels, images = read_test_split(data, {i for i, _ in chosen})
    if not np.array_equal(shard_labels, labels):
        raise UserError(
            f"the test predictions do not belong to {data.path}'s test split (its true classes differ): "
            "run `covidxray evaluate` on this data again, or give the --data-dir the run was evaluated on"
        )
    if not chosen:
        return []
    predicted = [int(probabilities[i].argmax()) for i, _ in chosen]
    batch = np.stack([images[i][:, :, None] for i, _ in chosen]).astype(np.float32)
    heat = heatmaps(score_function(model), batch, predicted)
    return [
        Example(
            index,
            kind,
            int(labels[index]),
            label,
            float(probabilities[index, label]),
            _png(images[index]),
            _png(overlay(images[index], cam)),
        )
        for (index, kind), label, cam in zip(chosen, predicted, heat)
    ]
