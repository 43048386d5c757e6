"""Test metrics per source: is the model good at the disease, or at telling the collections apart?

In a merged set each class tends to come from its own collection (children from one
hospital, adults from papers, NIH adults), so a score on the whole test split can
hide a model that learned the source. Per source, the same report as overall
(accuracy, per-class sensitivity/specificity at argmax and at the val-chosen
thresholds, AUC where the source has both positives and negatives) shows whether a
class is recognised within one collection; a source that train never saw reads as
a generalisation figure and is labelled so.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from covidxray.manifest import Manifest, PreparedData
from covidxray.train.metrics import expected_calibration_error

UNSEEN = "unseen source"


def split_sources(data: PreparedData, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(source, label) of every record of `split`, in the order `make_dataset` yields them for one rank (evaluation)."""
    import tensorflow as tf

    from covidxray.data.tfrecord import FEATURES
    from covidxray.train.input import assign_shards, rank_records

    paths = data.shards(split)
    if not paths:
        return np.zeros(0, dtype=object), np.zeros(0, np.int64)
    wanted = {key: FEATURES[key] for key in ("source", "label")}
    records = rank_records(assign_shards(paths, 0, 1), 0, 1, training=False, seed=0)
    sources, labels = [], []
    for parsed in records.map(lambda serialized: tf.io.parse_single_example(serialized, wanted)):
        sources.append(parsed["source"].numpy().decode())
        labels.append(int(parsed["label"]))
    return np.array(sources, dtype=object), np.array(labels, np.int64)


def unseen_sources(manifest: Manifest) -> set[str]:
    """Test sources the model never trained on: the held-out source, and any source with no train image."""
    in_train = manifest.splits["train"].sources
    unseen = {s for s in manifest.splits["test"].sources if not in_train.get(s)}
    held_out = manifest.data_config.get("holdout_source")
    return unseen | ({held_out} if held_out else set())


def per_source_report(
    labels: np.ndarray,
    probabilities: np.ndarray,
    sources: np.ndarray,
    manifest: Manifest,
    report: Callable[[np.ndarray, np.ndarray], dict],
    unseen: set[str] | None = None,
) -> dict:
    """`report(labels, probabilities)` on each source's subset of the test split, with its class counts, ECE and
    whether train saw the source (`unseen`, `train_images`). `manifest` is the training data's; `unseen`
    (default: unseen_sources(manifest)) names the sources to label as never trained on."""
    names = manifest.labels
    unseen = unseen_sources(manifest) if unseen is None else unseen
    in_train = manifest.splits["train"].sources
    out = {}
    for source in sorted(set(sources.tolist())):
        members = sources == source
        subset_labels, subset_probs = labels[members], probabilities[members]
        out[source] = {
            **report(subset_labels, subset_probs),
            "classes": {name: int((subset_labels == c).sum()) for c, name in enumerate(names)},
            "ece": expected_calibration_error(subset_labels, subset_probs),
            "train_images": int(in_train.get(source, 0)),
            "unseen": source in unseen,
        }
    return out
