"""Source-balanced training (`train.sampling: by_source`): less to gain from learning which collection a film came from.

In a merge of public collections each class comes mostly from one collection
(docs/datasets.md, "Source bias"), so "which collection" predicts "which
class", and a model learns it. Two changes take that gain away as far as the
data allows:

- class weights within each source: each source's classes are weighted
  against that source's own class counts (count^-train.class_weight_power,
  mean 1 over the source's images), instead of against the whole train
  split's. Within a source the classes then carry equal weight, so the
  source alone no longer says which class is likely; a class a source lacks
  stays absent from it, which no weighting can change;
- stratified batches: prepare writes the shards in record order, which groups
  them by source, so a shuffle buffer can serve long runs of one source.
  Every source gets a stream of its own, drawn in proportion to its share of
  the train split, so every batch holds every source in proportion.

The same record stream also carries each image's source index when the model
has a source adversary (covidxray/train/source_adversary.py).
"""

from __future__ import annotations

from covidxray.config import TrainConfig
from covidxray.manifest import Manifest
from covidxray.train.input import SourceAware

SHUFFLE, BY_SOURCE = "shuffle", "by_source"


def train_sources(manifest: Manifest) -> tuple[str, ...]:
    """The sources of the train split, sorted: position = source index."""
    return tuple(sorted(name for name, count in manifest.splits["train"].sources.items() if count))


def within_source_weights(manifest: Manifest, power: float) -> tuple[tuple[float, ...], ...]:
    """Per source (train_sources order), per class: weight ~ count^-power within the source, mean 1 over its images."""
    from covidxray.train.trainer import class_weights  # the rule the whole-split weights use, applied per source

    labels = manifest.labels
    by_source = manifest.splits["train"].source_classes
    return tuple(
        tuple(class_weights(by_source[name], labels, power)[c] for c in range(len(labels)))
        for name in train_sources(manifest)
    )


def source_aware(cfg: TrainConfig, manifest: Manifest, source_input: bool) -> SourceAware | None:
    """What the training stream must know of sources for this config, or None (the plain shuffled stream)."""
    if cfg.sampling == SHUFFLE and not source_input:
        return None
    sources = train_sources(manifest)
    if cfg.sampling == SHUFFLE:
        return SourceAware(sources, source_input=True)
    counts = manifest.splits["train"].sources
    total = sum(counts[name] for name in sources)
    power = cfg.class_weight_power if cfg.class_weights else 0.0  # power 0: every weight 1
    return SourceAware(
        sources,
        shares=tuple(counts[name] / total for name in sources),
        weights=within_source_weights(manifest, power),
        source_input=source_input,
    )


def class_weights_in_stream(cfg: TrainConfig) -> bool:
    """True when the stream carries the sample weights (Keras' class_weight would multiply them)."""
    return cfg.sampling == BY_SOURCE
