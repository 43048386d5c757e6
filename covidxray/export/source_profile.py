"""Fit the per-source profile predict warns with (covidxray/edge/source_profile.py) and write it into the sidecar.

The embeddings come from the exported model itself, through the LiteRT
interpreter, one image at a time, as predict will compute them; the train
split gives each source's mean and the shared covariance, the val split each
source's limit. A source with no val image gets the largest limit of the
others (its train images alone would set a limit no held-back image tested).
"""

from __future__ import annotations

import numpy as np

from covidxray.data.tfrecord import read_records
from covidxray.edge import ood
from covidxray.edge.litert import TFLiteClassifier
from covidxray.edge.source_profile import SIDECAR_KEY, SourceProfile
from covidxray.manifest import PreparedData


def embeddings_by_source(classifier: TFLiteClassifier, data: PreparedData, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(embeddings, source names) of every image of `split`, through the interpreter."""
    embeddings, sources = [], []
    for record in read_records(data.shards(split)):
        embeddings.append(classifier.infer(record["image"].astype(np.float32))[1])
        sources.append(record["source"])
    return np.array(embeddings), np.array(sources, dtype=object)


def fit(
    train_embeddings: np.ndarray,
    train_sources: np.ndarray,
    val_embeddings: np.ndarray,
    val_sources: np.ndarray,
    margin: float,
) -> SourceProfile:
    """Source means and shared precision on train, each source's limit on its val images (see the module docstring)."""
    names = sorted(set(train_sources.tolist()))
    index = np.array([names.index(s) for s in train_sources])
    means, precision, _ = ood.fit(train_embeddings, index, len(names))
    profile = SourceProfile(names, means, precision, np.ones(len(names)))
    known = np.array([s in names for s in val_sources.tolist()], bool)
    distances = profile.distances(val_embeddings[known]) if known.any() else np.zeros((0, len(names)))
    own = np.array([names.index(s) for s in val_sources[known]], int)
    limits = np.array([distances[own == i, i].max() if (own == i).any() else np.nan for i in range(len(names))])
    if np.isnan(limits).all():
        raise ValueError("no val image of any training source: the profile's limits cannot be set")
    profile.limits = np.where(np.isnan(limits), np.nanmax(limits), limits) * margin
    return profile


def sidecar_entry(classifier: TFLiteClassifier, data: PreparedData, margin: float) -> dict:
    """The sidecar's `source_profile` entry for the exported model in `classifier`."""
    train_embeddings, train_sources = embeddings_by_source(classifier, data, "train")
    val_embeddings, val_sources = embeddings_by_source(classifier, data, "val")
    profile = fit(train_embeddings, train_sources, val_embeddings, val_sources, margin)
    val_unlike = profile.unlike_every_source(val_embeddings)
    return profile.to_sidecar(
        {
            "margin": margin,
            "train_images": {s: int((train_sources == s).sum()) for s in profile.sources},
            "val_images": {s: int((val_sources == s).sum()) for s in profile.sources},
            "val_unlike_every_source": float(val_unlike.mean()) if len(val_unlike) else None,
        }
    )


__all__ = ["SIDECAR_KEY", "embeddings_by_source", "fit", "sidecar_entry"]
