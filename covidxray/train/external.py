"""`covidxray evaluate --external DATA_DIR`: the model on a data set prepared from elsewhere, copies of training images removed.

A clinic gets the figure of data the model never saw, not the test split's:
a test split shares hospitals, scanners and image styles with train, so a
model that learned the source scores well there (docs/datasets.md, "Source
bias"). An external data set is prepared separately (`covidxray prepare`,
any sources) and every image of it, whatever split prepare gave it, is test.

Public collections copy each other, so before any image is scored the
external set is checked against the training data (its train and val splits)
with the matching `prepare` dedups with (covidxray/data/dedup.py: exact
pixels, perceptual hash, geometric check) at the thresholds that prepared the
training data, and for patients: an external image that copies a training
image, or shows a patient the training data holds, is dropped, counted and
listed (EXTERNAL_COPIES), so leakage cannot inflate the external figure. The
check reads both data sets' decode caches, so it decodes nothing already
decoded by prepare; it needs the original image files both were prepared
from (the caches are keyed by their content).

The thresholds are the ones chosen on the training data's val split, as for
the test split: nothing about the external set is tuned on it.
"""

from __future__ import annotations

import csv
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from covidxray.config import DataConfig
from covidxray.data import dedup
from covidxray.data.image_cache import ImageCache, cache_path
from covidxray.errors import UserError
from covidxray.files import atomic_open
from covidxray.manifest import SPLIT_TABLE, Manifest, PreparedData, open_prepared
from covidxray.records import Record
from covidxray.reports import ExternalReport, SourceMetrics
from covidxray.run_folder import ModelCard
from covidxray.train.by_source import per_source_report
from covidxray.train.metrics import expected_calibration_error
from covidxray.train.run_guard import recorded_dataset_id

TRAINING_SPLITS = ("train", "val")
EXTERNAL_PATIENT = (
    "external:"  # prefix: dedup treats near copies of one patient as follow-ups; across the sets they are leaks
)
COPY_COLUMNS = ["kind", "evidence", "external_source", "external_image", "training_split", "training_image"]
# the settings a shard's pixels depend on: the model can only be measured on pixels made like its training data's
PIXEL_SETTINGS = ("task", "labels", "image_size", "preprocessing")


@dataclass(frozen=True)
class Copy:
    """An external image dropped before scoring: a copy of a training image, or a training patient's image."""

    kind: str  # "exact", "perceptual", "geometric" (dedup's match kinds) or "patient"
    evidence: str
    external: Record
    training: Record
    training_split: str

    def row(self) -> list[str]:
        return [
            self.kind,
            self.evidence,
            self.external.source,
            str(self.external.image),
            self.training_split,
            str(self.training.image),
        ]


def check_fits(card: ModelCard, manifest: Manifest, external_dir: Path) -> None:
    """UserError when the external set's task, labels, image size or pixel preprocessing differ from the model's."""
    wanted: dict[str, Any] = {key: getattr(card, key) for key in (*PIXEL_SETTINGS, "harmonise")}
    found: dict[str, Any] = {key: getattr(manifest, key) for key in wanted}
    differ = [key for key in wanted if wanted[key] is not None and found[key] != wanted[key]]
    if differ:
        raise UserError(
            f"external data {external_dir} does not fit the model: "
            + "; ".join(f"its {key} is {found[key]!r}, the model's {wanted[key]!r}" for key in differ)
            + f". Prepare it again for this model: covidxray prepare --source ... --task {wanted['task']} "
            f"--image-size {wanted['image_size']} --set data.harmonise={wanted['harmonise']} --data-dir {external_dir}"
        )


def _trained_on(run_dir: Path, training: PreparedData, same_data: bool) -> bool:
    """Whether `training` is the data the run trained on: by the model card's record, or, for a card written before
    dataset_id existed, by the run's inputs (covidxray/train/run_guard.py records the data set's id)."""
    return same_data or recorded_dataset_id(run_dir) == training.dataset_id


def checked_externals(
    card: ModelCard, run_dir: Path, training: PreparedData, same_data: bool, externals: list[str] | tuple[str, ...]
) -> list[PreparedData]:
    """Before anything is predicted: every external set, opened (its manifest read once, here), fits the model, and
    the copy check has the training data."""
    training_dir = training.path
    if externals and not _trained_on(run_dir, training, same_data):
        raise UserError(
            f"--external checks the external images against the training data, but {training_dir} is not the data set "
            "the model was trained on (its manifest hash differs from the model card's): point --data-dir at it"
        )
    opened = []
    for external_dir in externals:
        if Path(external_dir).resolve() == Path(training_dir).resolve():
            raise UserError(
                f"--external {external_dir} is the training data set itself: prepare the external set separately"
            )
        external = open_prepared(external_dir)
        check_fits(card, external.manifest, external.path)
        opened.append(external)
    return opened


def _split_table(data: PreparedData) -> list[tuple[str, Record]]:
    path = data.table(SPLIT_TABLE)
    if not path.is_file():
        raise UserError(f"{path} not found: the dedup check needs the table prepare writes; re-run `covidxray prepare`")
    with open(path, newline="") as handle:
        return [
            (
                row["split"],
                Record(
                    image=Path(row["image"]), label=row["label"], patient_id=row["patient_id"], source=row["source"]
                ),
            )
            for row in csv.DictReader(handle)
        ]


def _signatures(data: PreparedData, records: list[Record], config: DataConfig, progress, log) -> dict:
    """Decoded (hashes, features) of every record's original file, through the data set's own decode cache."""
    prepared = replace(config, image_size=data.manifest.image_size, harmonise=data.manifest.harmonise)
    with ImageCache(cache_path(data.path, prepared.image_size, prepared.harmonise), log) as cache:
        decoded, _ = cache.decode_configured([str(r.image) for r in records], prepared, progress, log)
    return decoded


def find_copies(
    training: PreparedData,
    external: PreparedData,
    config: DataConfig,
    progress: Callable[..., None] | None = None,
    log: Callable[[str], None] = print,
) -> tuple[list[Copy], list[Record]]:
    """(copies of training images or patients among the external images, external images that could not be checked).

    Training images = the train and val splits of `training`; external = every image of `external`.
    """
    progress = progress or (lambda done, total=None: None)
    training_records = [(split, r) for split, r in _split_table(training) if split in TRAINING_SPLITS]
    # prefixed ids: dedup never takes an external image for a follow-up of a training patient
    external_records = [replace(r, patient_id=EXTERNAL_PATIENT + r.patient_id) for _, r in _split_table(external)]
    progress(0, len(training_records) + len(external_records))
    step = lambda done, total=None: progress(done)  # noqa: E731 - one bar over both data sets
    trained = _signatures(training, [r for _, r in training_records], config, step, log)
    _refuse_unreadable(training.path, [r for _, r in training_records], trained)
    seen = _signatures(external, external_records, config, step, log)
    checked = [r for r in external_records if seen[str(r.image)].ok]
    settings = training.manifest.data_config
    copies = _image_copies(training_records, checked, {**trained, **seen}, settings, config)
    _add_patient_copies(copies, training_records, checked)
    found = [
        replace(c, external=_original(c.external)) for c in sorted(copies.values(), key=lambda c: str(c.external.image))
    ]
    return found, [_original(r) for r in external_records if not seen[str(r.image)].ok]


def _refuse_unreadable(training_dir: Path, training: list[Record], decoded: dict) -> None:
    """UserError when a training image cannot be decoded: the check could then miss copies of it."""
    unreadable = [r for r in training if not decoded[str(r.image)].ok]
    if unreadable:
        raise UserError(
            f"{len(unreadable)} training image(s) of {training_dir} cannot be read for the copy check, e.g. "
            f"{unreadable[0].image}: {decoded[str(unreadable[0].image)].detail}. The check compares the original files "
            "prepare read (its decode cache is keyed by their content): restore them, or the external figure could "
            "count copies of training images"
        )


def _image_copies(
    training: list[tuple[str, Record]], checked: list[Record], decoded: dict, settings: dict, config: DataConfig
) -> dict[Record, Copy]:
    """External images that copy a training image (dedup's matches between the two sets, at the thresholds that
    prepared the training data), each with the first training image it matched."""
    everything = [r for _, r in training] + checked
    split_of = {r: split for split, r in training}
    hashes = {str(r.image): (decoded[str(r.image)].pixel_sha256, decoded[str(r.image)].phash) for r in everything}
    features = {str(r.image): decoded[str(r.image)].features for r in everything}
    edges = dedup.matches(
        everything,
        hashes,
        features,
        int(settings.get("dedup_max_distance", config.dedup_max_distance)),
        int(settings.get("dedup_min_inliers", config.dedup_min_inliers)),
    )
    copies: dict[Record, Copy] = {}
    for i, j, kind, _, evidence in edges:
        first, second = everything[i], everything[j]
        if (first in split_of) == (second in split_of):
            continue  # two training images, or two external ones: prepare's business, not leakage
        outside, inside = (second, first) if first in split_of else (first, second)
        copies.setdefault(outside, Copy(kind, evidence, outside, inside, split_of[inside]))
    return copies


def _add_patient_copies(copies: dict[Record, Copy], training: list[tuple[str, Record]], checked: list[Record]) -> None:
    """Into `copies`: the external images not already copies that show a patient the training data holds."""
    split_of = {r: split for split, r in training}
    training_patients = {r.patient_id: r for _, r in reversed(training)}  # each patient's first training image
    for record in checked:
        twin = training_patients.get(_original(record).patient_id)
        if twin is not None and record not in copies:
            copies[record] = Copy(
                "patient", f"patient {twin.patient_id} is in the training data", record, twin, split_of[twin]
            )


def _original(external: Record) -> Record:
    """An external record with its own patient id again (without the EXTERNAL_PATIENT prefix)."""
    return replace(external, patient_id=external.patient_id[len(EXTERNAL_PATIENT) :])


def write_copies(path: Path, copies: list[Copy]) -> None:
    with atomic_open(path, "w", newline="", errors="backslashreplace") as handle:
        writer = csv.writer(handle)
        writer.writerow(COPY_COLUMNS)
        writer.writerows(copy.row() for copy in copies)


def predict_records(
    model, data: PreparedData, dropped_ids: set[str], batch: int = 64
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(probabilities, labels, sources) of every image in every split of `data` but `dropped_ids`, and how many were dropped."""
    from covidxray.data.tfrecord import read_records

    paths = [p for split in ("train", "val", "test") for p in data.shards(split)]
    probabilities: list[np.ndarray] = []
    labels: list[int] = []
    sources: list[str] = []
    images: list[np.ndarray] = []
    skipped = 0

    def flush() -> None:
        if images:
            probabilities.append(model.predict_on_batch(np.stack(images).astype(np.float32)))
            images.clear()

    for record in read_records(paths):
        if record["record_id"] in dropped_ids:
            skipped += 1
            continue
        images.append(record["image"])
        labels.append(record["label"])
        sources.append(record["source"])
        if len(images) == batch:
            flush()
    flush()
    width = model.output_shape[-1]
    stacked = np.concatenate(probabilities) if probabilities else np.zeros((0, width), np.float32)
    return stacked, np.array(labels, np.int64), np.array(sources, dtype=object), skipped


def external_report(
    model,
    card: ModelCard,
    training: PreparedData,
    external: PreparedData,
    config: DataConfig,
    report: Callable[[np.ndarray, np.ndarray], dict],
    copies_path: Path,
    progress: Callable[..., None] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """The external set's report (`report` on its images that are no copies), with what was dropped and why.
    `external` has passed `checked_externals`."""
    copies, unchecked = find_copies(training, external, config, progress, log)
    write_copies(copies_path, copies)
    dropped = {c.external.record_id for c in copies} | {r.record_id for r in unchecked}
    probabilities, labels, sources = _scored(model, external, dropped)
    training_manifest = training.manifest
    in_train = training_manifest.splits["train"].sources
    entry = report(labels, probabilities)
    entry.update(
        {
            "data_dir": str(external.path),
            "images_prepared": sum(external.manifest.splits[split].records for split in ("train", "val", "test")),
            **_class_counts(labels, card.labels, training_manifest),
            **_dropped_entry(copies, unchecked, dropped, copies_path),
            "ece": expected_calibration_error(labels, probabilities),
            "per_source": per_source_report(
                labels,
                probabilities,
                sources,
                training_manifest,
                report,
                unseen={s for s in set(sources.tolist()) if not in_train.get(s)},
            ),
        }
    )
    return entry


def _scored(model, external: PreparedData, dropped: set[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(probabilities, labels, sources) of the external images not `dropped`; refused when none is left."""
    probabilities, labels, sources, skipped = predict_records(model, external, dropped)
    if skipped != len(dropped):
        raise AssertionError(f"{len(dropped)} external images to drop, but {skipped} of them found in the shards")
    if not labels.size:
        raise UserError(
            f"external data {external.path}: every image is a copy of a training image; nothing left to score"
        )
    return probabilities, labels, sources


def _class_counts(labels: np.ndarray, names: list[str], training_manifest: Manifest) -> dict:
    return {
        "classes": {name: int((labels == c).sum()) for c, name in enumerate(names)},
        # external images of a class the model never trained on: no recipe can recognise them
        "untrained_classes": {
            name: int((labels == c).sum())
            for c, name in enumerate(names)
            if (labels == c).any() and not training_manifest.splits["train"].classes.get(name)
        },
    }


def _dropped_entry(copies: list[Copy], unchecked: list[Record], dropped: set[str], copies_path: Path) -> dict:
    return {
        "dropped_as_copies": len(copies),
        "dropped_by_kind": dict(sorted(Counter(c.kind for c in copies).items())),
        "dropped_unchecked": len(unchecked),
        "copies_table": copies_path.name,
        "copies": [dict(zip(COPY_COLUMNS, c.row())) for c in copies],
        "dropped_record_ids": sorted(dropped),  # as in the shards: what a re-scoring must leave out
    }


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def describe(entry: ExternalReport, describe_source: Callable[[str, SourceMetrics], str]) -> list[str]:
    """Console lines for one external set's report, beside the test split's."""
    counts = ", ".join(f"{name} {n}" for name, n in entry.classes.items())
    kinds = ", ".join(f"{n} {kind}" for kind, n in entry.dropped_by_kind.items()) or "none"
    lines = [
        f"external {entry.data_dir}: {entry.images} images ({counts}) of {entry.images_prepared} prepared; "
        f"dropped {entry.dropped_as_copies} as copies of training images or patients ({kinds}; listed in "
        f"{entry.copies_table})"
        + (f" and {entry.dropped_unchecked} that could not be checked" if entry.dropped_unchecked else ""),
        f"  accuracy {_fmt(entry.accuracy)}, macro ROC AUC {_fmt(entry.macro_roc_auc)}, ECE {entry.ece:.3f}",
    ]
    for name, count in entry.untrained_classes.items():
        lines.append(f"  {name}: {count} external images, but no training image of {name}: the model cannot know it")
    for name, per_class in entry.per_class.items():
        rates = per_class.argmax
        lines.append(
            f"  {name:12s} AUC {_fmt(per_class.roc_auc)}  argmax sensitivity {_fmt(rates.sensitivity)} "
            f"specificity {_fmt(rates.specificity)} ({per_class.support} images)"
        )
    if len(entry.per_source) > 1:
        lines += [describe_source(source, item) for source, item in entry.per_source.items()]
    return lines
