"""`covidxray prepare`: sources -> harmonised, deduplicated, patient-split, sharded TFRecords.

Order matters: every image is decoded once (in parallel, cached), then
duplicates are removed, then patients are split, then shards are written
from the decoded cache. Shards are planned from the sorted record list, so
the plan (and every shard's bytes) depends only on the inputs and the config.
Each finished shard gets a small JSON receipt; a re-run or a resumed run
skips shards whose receipt matches the plan and whose bytes still match the
receipt's sha256 (a damaged shard or receipt is rewritten, not trusted),
which makes a killed run cheap to restart and yields identical shards.
Shards are named after their content and manifest.json is replaced last, in
one rename, so the data set switches atomically (see covidxray/manifest.py).

Nothing unusable is silent: every dropped row or file is counted per reason
in manifest.json and listed in dropped.csv; every removed duplicate in
duplicates.csv; every kept image with its patient and split in splits.csv.
These tables (with absolute image paths, so `covidxray audit` reads them
from anywhere) are written in full before the manifest switches and moved
into place right after it, and the manifest records their sha256: they never
describe another data set than the live manifest without it showing.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from covidxray.config import DataConfig
from covidxray.data import audit, dedup
from covidxray.data.composition import composition
from covidxray.data.image_cache import Decoded, ImageCache, cache_path, workers_of
from covidxray.data.labels import Task, get_task, missing_classes
from covidxray.data.split import SPLITS, make_splits, patients_overlap
from covidxray.edge import harmonise as harmonise_method
from covidxray.edge import preprocess
from covidxray.errors import UserError
from covidxray.files import atomic_write, discard, output_folder, publish, sha256_file, staged_path
from covidxray.manifest import (
    DROPPED_TABLE,
    DUPLICATE_TABLE,
    RAW_DIR,
    SHARD_DIR,
    SPLIT_TABLE,
    TABLE_SHA256,
    Manifest,
    open_prepared,
    write_manifest,
)
from covidxray.records import Dropped, Record
from covidxray.sources import SourceContext, build_source
from covidxray.sources.descriptors import dedup_priority
from covidxray.sources.layout import OUTSIDE, within
from covidxray.sources.unmapped import override_hint

DUPLICATE_COLUMNS = [  # one row per removed copy; `kept_*` is the copy kept in its place (or, for a dropped label conflict, its twin)
    "kind",
    "distance",
    "evidence",
    "outcome",
    "removed_source",
    "removed_image",
    "removed_patient",
    "removed_label",
    "kept_source",
    "kept_image",
    "kept_patient",
    "kept_label",
]
Progress = Callable[..., None]  # progress(done, total=None)


@dataclass
class Collected:
    records: list[Record] = field(default_factory=list)
    dropped: list[tuple[str, Dropped]] = field(default_factory=list)  # (source, why)
    sources: dict[str, dict] = field(default_factory=dict)


def collect_records(config: DataConfig, task: Task, cache_dir: Path) -> Collected:
    collected = Collected()
    for name, options in config.sources.items():
        source = build_source(name, options, SourceContext.of(config))
        root, provenance = source.fetch(cache_dir / name)
        found = 0
        for item in source.records(root):
            if isinstance(item, Dropped):
                collected.dropped.append((name, item))
            elif not within(root, item.image):  # whatever the adapter: nothing is read from outside the collection
                collected.dropped.append((name, Dropped(OUTSIDE, str(item.image))))
            elif task.class_of(item.label) is None:
                collected.dropped.append(
                    (name, Dropped(f"label {item.label!r} not in task {task.name}", str(item.image)))
                )
            else:
                collected.records.append(item)
                found += 1
        collected.sources[name] = {"root": str(root), **provenance, "records_found": found}
    collected.records.sort(key=lambda r: (r.record_id, str(r.image)))
    return collected


def plan_shards(splits: dict[str, list[Record]], records_per_shard: int) -> list[tuple[str, list[Record]]]:
    plan = []
    for split in SPLITS:
        records = splits[split]
        count = max(1, -(-len(records) // records_per_shard)) if records else 0
        for i in range(count):
            chunk = records[i * len(records) // count : (i + 1) * len(records) // count]
            plan.append((f"{split}-{i:05d}-of-{count:05d}.tfrecord", chunk))
    return plan


def _fingerprint(
    records: list[Record],
    task: Task,
    image_size: int,
    decoded: dict[str, Decoded],
    harmonise: str = harmonise_method.NONE,
) -> str:
    """Everything a shard's bytes depend on (not where the files sit), so equal shards get equal names anywhere."""
    definition = [task.name, image_size, dedup.HASH_VERSION, preprocess.PREPROCESSING_VERSION]
    # harmonised pixels: another name; unharmonised shards keep theirs
    digest = hashlib.sha256(
        json.dumps(definition + ([harmonise] if harmonise != harmonise_method.NONE else [])).encode()
    )
    for r in records:  # surrogateescape: a name made from a file name that is not UTF-8 keeps its own bytes
        line = f"{r.record_id}|{r.source}|{r.patient_id}|{r.label}|{decoded[str(r.image)].pixel_sha256.hex()}\n"
        digest.update(line.encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def _shard_name(planned: str, fingerprint: str) -> str:
    """`train-00000-of-00004.tfrecord` -> `train-00000-of-00004-<fingerprint>.tfrecord`: new content, new name."""
    return planned.replace(".tfrecord", f"-{fingerprint[:12]}.tfrecord")


def _write_shard(
    path: Path,
    records: list[Record],
    task: Task,
    cache: ImageCache,
    contents: dict[str, bytes],
    fingerprint: str,
    progress: Progress,
) -> dict:
    from covidxray.data import tfrecord

    def examples():
        for record in records:
            progress(1)
            png = cache.png(contents[str(record.image)])
            yield tfrecord.make_example(
                png, task.index_of(record.label), record.patient_id, record.source, record.record_id
            )

    written = tfrecord.write_shard(path, examples())
    receipt = {
        "file": path.name,
        "split": path.name.split("-")[0],
        "fingerprint": fingerprint,
        "records": written,
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
    }
    atomic_write(path.with_suffix(".json"), json.dumps(receipt, indent=1))
    return receipt


def _receipt_if_done(path: Path, fingerprint: str, log: Callable[[str], None]) -> dict | None:
    """The receipt of a finished, intact shard of this plan; None (the shard is rewritten) otherwise."""
    receipt_path = path.with_suffix(".json")
    if not (path.is_file() and receipt_path.is_file()):
        return None
    try:
        receipt = json.loads(receipt_path.read_text())
        done = receipt["fingerprint"] == fingerprint and receipt["bytes"] == path.stat().st_size
    except (ValueError, TypeError, KeyError) as err:
        log(f"shard receipt {receipt_path} is damaged ({err.__class__.__name__}); rewriting {path.name}")
        return None
    if done and receipt.get("sha256") != sha256_file(path):
        log(f"shard {path} is damaged (its sha256 differs from its receipt); rewriting it")
        return None
    return receipt if done else None


def _where(path: Path | str) -> str:
    """An image path as the tables give it: absolute (prepare may have been given a relative --source)."""
    return os.path.abspath(path)


def stage_tables(
    out: Path, task: Task, splits: dict[str, list[Record]], dropped, duplicates: list[dedup.Duplicate]
) -> dict[str, Path]:
    """splits.csv, dropped.csv and duplicates.csv of the new data set, each written in full beside its final name
    (`<name>.partial`) to be published after the manifest switch: table name -> staged file."""
    tables: dict[str, tuple[list[str], Iterable[Iterable[object]]]] = {
        SPLIT_TABLE: (
            ["split", "patient_id", "source", "label", "class", "view", "image"],
            (
                [s, r.patient_id, r.source, r.label, task.class_of(r.label), r.view, _where(r.image)]
                for s in SPLITS
                for r in splits[s]
            ),
        ),
        DROPPED_TABLE: (
            ["source", "reason", "where", "detail"],
            ([s, d.reason, d.where, d.detail] for s, d in dropped),
        ),
        DUPLICATE_TABLE: (
            DUPLICATE_COLUMNS,
            (
                [
                    d.kind,
                    d.distance,
                    d.evidence,
                    _outcome(d),
                    d.removed.source,
                    _where(d.removed.image),
                    d.removed.patient_id,
                    d.removed.label,
                    d.kept.source,
                    _where(d.kept.image),
                    d.kept.patient_id,
                    d.kept.label,
                ]
                for d in duplicates
            ),
        ),
    }
    staged: dict[str, Path] = {}
    try:
        for name, (header, rows) in tables.items():
            staged[name] = staged_path(out / name)
            with open(
                staged[name], "w", newline="", errors="backslashreplace"
            ) as handle:  # non-UTF-8 names stay readable
                writer = csv.writer(handle)
                writer.writerow(header)
                writer.writerows(rows)
                handle.flush()
                os.fsync(handle.fileno())  # on disk before the manifest that names its sha256
    except BaseException:
        for path in staged.values():
            discard(path)
        raise
    return staged


def _outcome(duplicate: dedup.Duplicate) -> str:
    if not duplicate.label_conflict:
        return "removed"
    return "label conflict: kept by priority" if duplicate.kept_too else "label conflict: every copy dropped"


def _no_records(what: str, task: Task, config: DataConfig, dropped: list[tuple[str, Dropped]]) -> UserError:
    top = Counter(f"{s}: {d.reason}" for s, d in dropped).most_common(3)
    hint = "; most common drops: " + "; ".join(f"{n} x {reason}" for reason, n in top) if top else ""
    return UserError(f"no usable {what} for task {task.name} in sources {', '.join(config.sources)}{hint}")


def _warn_of_missing_classes(task: Task, records: list[Record], where: str, log: Callable[[str], None]) -> bool:
    """Whether a class of `task` has no image in `records`, said as a warning: such a data set still serves as an
    external test set (`evaluate --external`, a held-out source), and `train` refuses it."""
    message = missing_classes(task, Counter(task.class_of(r.label) for r in records), where)
    if message:
        log(f"warning: {message}. `covidxray train` refuses such a data set; it can serve as an external test set")
    return message is not None


def prepare(config: DataConfig, progress: Progress | None = None, log: Callable[[str], None] = print) -> Manifest:
    """Run the whole preparation; returns the manifest it wrote.

    collect -> decode -> dedupe -> split -> shard -> switch to the new manifest -> publish the tables.
    """
    started = time.time()
    task = get_task(config.task)
    check_settings_together(config)
    progress = progress or (lambda done, total=None: None)
    out = output_folder(config.data_dir, "--data-dir")
    shard_dir = output_folder(out / SHARD_DIR, "--data-dir")

    collected, lacking = collect_sources(config, task, out / RAW_DIR, log)
    with ImageCache(cache_path(out, config.image_size, config.harmonise), log) as cache:
        usable, decoded, contents = decode_images(collected, config, task, cache, progress, log)
        deduped = dedupe(usable, decoded, config, log)
        splits, split_report = split_records(deduped, task, config, lacking, log)
        plan = plan_shards(splits, config.records_per_shard)
        for partial in shard_dir.glob("*.partial"):  # a killed run's unfinished file; finished shards may be reused
            partial.unlink()
        decode_total = len({str(r.image) for r in collected.records})
        progress(0, decode_total + sum(len(chunk) for _, chunk in plan))
        try:  # beside the current data set: its manifest and shards stay valid until the switch
            receipts, reused = write_shards(plan, shard_dir, task, config, cache, decoded, contents, progress, log)
            manifest, staged, previous = switch_to_new_data_set(
                out, config, task, collected, deduped, splits, split_report, receipts, reused, started
            )
        except OSError as err:  # out of disk, most often
            raise UserError(
                f"writing the new data set into {out} failed ({err.strerror or err}); the previous data set there, if any, is "
                f"untouched and still valid. Free some space (or use another --data-dir) and re-run prepare: finished shards are kept"
            ) from None

    for name, path in staged.items():  # renames within the folder: no new space needed
        publish(path, out / name)
    _remove_unlisted_shards(shard_dir, {s.file for s in manifest.shards} | previous)
    return manifest


def check_settings_together(config: DataConfig) -> None:
    """What loading a config cannot check field by field: the hold-out source against the sources and the split.
    The dedup distance's range is checked again because a DataConfig built in code never went through loading."""
    if config.holdout_source and config.holdout_source not in config.sources:
        raise UserError(
            f"data.holdout_source: {config.holdout_source!r} is not one of the sources being prepared ({', '.join(config.sources)})"
        )
    if config.holdout_source and config.split == "source":
        raise UserError(
            "data.holdout_source makes the held-out source the whole test split; it cannot be combined with data.split: source"
        )
    (distance,) = [spec for spec in dataclasses.fields(DataConfig) if spec.name == "dedup_max_distance"]
    low, high = distance.metadata["limits"]["low"], distance.metadata["limits"]["high"]
    if not low <= config.dedup_max_distance <= high:
        raise UserError(
            f"data.dedup_max_distance={config.dedup_max_distance}: use {low} (exact duplicates only) to {high}"
        )


def collect_sources(
    config: DataConfig, task: Task, raw_dir: Path, log: Callable[[str], None]
) -> tuple[Collected, bool]:
    """Every source's records of the task, and whether a class of the task has none (already said as a warning)."""
    collected = collect_records(config, task, raw_dir)
    for line in override_hint(collected.dropped):
        log(line)
    if not collected.records:
        raise _no_records("records", task, config, collected.dropped)
    lacking = _warn_of_missing_classes(task, collected.records, f"sources {', '.join(config.sources)}", log)
    return collected, lacking


def decode_images(
    collected: Collected,
    config: DataConfig,
    task: Task,
    cache: ImageCache,
    progress: Progress,
    log: Callable[[str], None],
) -> tuple[list[Record], dict[str, Decoded], dict[str, bytes]]:
    """Every image decoded once, through the cache: the records whose image decodes, each image's decoded
    outcome and file bytes. An image that does not decode joins `collected.dropped`, and one line per reason says so."""
    decoded, contents = cache.decode_configured([str(r.image) for r in collected.records], config, progress, log)
    usable, failed = [], []
    for record in collected.records:
        outcome = decoded[str(record.image)]
        if outcome.ok:
            usable.append(record)
        else:
            failed.append((record.source, Dropped(f"image {outcome.reason}", str(record.image), outcome.detail)))
    counts = Counter(f"{source}: {item.reason}" for source, item in failed)
    examples: dict[str, str] = {}
    for source, item in failed:
        examples.setdefault(f"{source}: {item.reason}", f"{item.where}: {item.detail}")
    for reason, example in examples.items():
        log(f"skipped {counts[reason]} file(s) ({reason}), e.g. {example}")
    collected.dropped += failed
    if not usable:
        raise _no_records("images", task, config, collected.dropped)
    return usable, decoded, contents


def dedupe(
    usable: list[Record], decoded: dict[str, Decoded], config: DataConfig, log: Callable[[str], None]
) -> dedup.DedupResult:
    """Exact, perceptual and geometric copies removed (the preferred source's copy kept), said in one line."""
    hashes = {str(r.image): (decoded[str(r.image)].pixel_sha256, decoded[str(r.image)].phash) for r in usable}
    priorities = {name: dedup_priority(name) for name in config.sources}
    features = {str(r.image): decoded[str(r.image)].features for r in usable}
    deduped = dedup.deduplicate(
        usable,
        hashes,
        priorities,
        config.dedup_max_distance,
        features,
        config.dedup_min_inliers,
        config.dedup_label_conflicts,
        threads=workers_of(config),
    )
    if deduped.duplicates:
        summary = deduped.summary()
        log(
            f"removed {summary['total']} duplicate image(s) ({summary['exact']} exact, {summary['perceptual']} perceptual, "
            f"{summary['geometric']} geometric; {summary['label_conflicts_dropped']} dropped for a label conflict); "
            f"merged {summary['patients_merged']} patient id(s); see {DUPLICATE_TABLE}"
        )
    return deduped


def split_records(
    deduped: dedup.DedupResult, task: Task, config: DataConfig, lacking: bool, log: Callable[[str], None]
) -> tuple[dict[str, list[Record]], dict]:
    """The kept records split by patient (or source) as configured: split name -> records, and the split's report.
    `lacking`: the sources already miss a class, so the train split's missing classes go unsaid."""
    splits, split_report = make_splits(
        deduped.kept,
        task,
        config.split,
        config.holdout_source,
        config.val_fraction,
        config.test_fraction,
        config.seed,
    )
    if not lacking:
        _warn_of_missing_classes(task, splits["train"], "the train split", log)
    if split_report.get("patients_moved_to_test"):
        log(
            f"{split_report['patients_moved_to_test']} patient(s) had images on both sides of the {split_report['mode']} split: "
            f"all their images went to test ({split_report['records_moved_to_test']} image(s) moved there)"
        )
    _refuse_unsound_split(splits, deduped)
    return splits, split_report


def _refuse_unsound_split(splits: dict[str, list[Record]], deduped: dedup.DedupResult) -> None:
    overlap = patients_overlap(splits)
    if overlap:
        raise AssertionError(f"patient split is unsound: {overlap[:5]} in several splits")
    split_of = {(r.source, str(r.image)): name for name in SPLITS for r in splits[name]}
    leaks = audit.find_leaks(split_of, deduped.kept, deduped.matches)
    if leaks:  # the same check `covidxray audit` runs: no manifest for a split that leaks
        raise UserError(
            f"the split leaks ({len(leaks)} finding(s)), no manifest written: "
            + "; ".join(leak.line() for leak in leaks[:5])
        )


def write_shards(
    plan: list[tuple[str, list[Record]]],
    shard_dir: Path,
    task: Task,
    config: DataConfig,
    cache: ImageCache,
    decoded: dict[str, Decoded],
    contents: dict[str, bytes],
    progress: Progress,
    log: Callable[[str], None],
) -> tuple[list[dict], int]:
    """Each planned shard written under its content name, or reused when an intact one is already there:
    every shard's receipt, in plan order, and how many were reused."""
    receipts, reused = [], 0
    for planned, chunk in plan:
        fingerprint = _fingerprint(chunk, task, config.image_size, decoded, config.harmonise)
        path = shard_dir / _shard_name(planned, fingerprint)
        receipt = _receipt_if_done(path, fingerprint, log)
        if receipt is None:
            receipt = _write_shard(path, chunk, task, cache, contents, fingerprint, progress)
        else:
            reused += 1
            progress(len(chunk))
        receipts.append(receipt)
    return receipts, reused


def switch_to_new_data_set(
    out: Path,
    config: DataConfig,
    task: Task,
    collected: Collected,
    deduped: dedup.DedupResult,
    splits: dict[str, list[Record]],
    split_report: dict,
    receipts: list[dict],
    reused: int,
    started: float,
) -> tuple[Manifest, dict[str, Path], set[str]]:
    """The tables staged beside their final names, then manifest.json replaced: from that rename on the new data
    set is live. Returns its manifest, the staged tables (for the caller to publish) and the shards the previous
    manifest listed (a reader may still be using them). On a failed write no staged table is left behind."""
    content = build_manifest(config, task, splits, receipts, collected.dropped, deduped, collected.sources)
    staged = stage_tables(out, task, splits, collected.dropped, deduped.duplicates)
    try:
        content |= {
            "shards_reused": reused,
            "split": split_report,
            TABLE_SHA256: {name: sha256_file(path) for name, path in staged.items()},
            "seconds": round(time.time() - started, 2),
        }
        previous = _listed_shards(out)
        manifest = write_manifest(out, content)
    except OSError:
        for path in staged.values():
            discard(path)
        raise
    return manifest, staged, previous


def _listed_shards(data_dir: Path) -> set[str]:
    """Shard files the current manifest lists (a reader may be using them); none when it is absent or damaged."""
    try:
        return {s.file for s in open_prepared(data_dir).manifest.shards}
    except UserError:
        return set()


def _remove_unlisted_shards(shard_dir: Path, keep: set[str]) -> None:
    """After the switch: drop shards (and receipts) neither the new nor the previous manifest lists."""
    for path in shard_dir.iterdir():
        if path.name.split(".")[0] + ".tfrecord" not in keep:
            path.unlink()


def _split_summary(records: list[Record], task: Task) -> dict:
    classes = Counter(task.class_of(r.label) for r in records)
    by_source: dict[str, Counter] = defaultdict(Counter)
    for r in records:
        by_source[r.source][task.class_of(r.label)] += 1
    return {
        "records": len(records),
        "patients": len({r.patient_id for r in records}),
        "classes": {c: classes.get(c, 0) for c in task.classes},
        "sources": {s: sum(c.values()) for s, c in sorted(by_source.items())},
        "source_classes": {s: {c: counts.get(c, 0) for c in task.classes} for s, counts in sorted(by_source.items())},
    }


def build_manifest(
    config: DataConfig, task: Task, splits, receipts: list[dict], dropped, deduped: dedup.DedupResult, sources: dict
) -> dict:
    per_split = {split: _split_summary(splits[split], task) for split in SPLITS}
    for split in SPLITS:  # the shards hold exactly the split: checked, not assumed
        in_shards = sum(r["records"] for r in receipts if r["split"] == split)
        if in_shards != per_split[split]["records"]:
            raise AssertionError(f"{split}: shards hold {in_shards} records, the split {per_split[split]['records']}")
    reasons = Counter(f"{source}: {item.reason}" for source, item in dropped)
    kept_per_source = Counter(r.source for split in SPLITS for r in splits[split])
    return {
        "format": "covidxray-shards/1",
        "task": task.name,
        "labels": list(task.classes),
        "image_size": config.image_size,
        "preprocessing": preprocess.PREPROCESSING_VERSION,
        "harmonise": config.harmonise,
        "splits": per_split,
        "patient_disjoint": not patients_overlap(splits),
        "composition": composition(per_split, list(task.classes), config.shortcut_warning_share),
        "sources": {name: {**info, "records_kept": kept_per_source.get(name, 0)} for name, info in sources.items()},
        "dropped": dict(sorted(reasons.items())),
        "dropped_total": len(dropped),
        "duplicates_removed": deduped.summary(),
        "dedup": {
            "exact": "sha256 of decoded full-resolution gray pixels",
            "perceptual": f"256-bit DCT hash, Hamming distance <= {config.dedup_max_distance} between different patients",
            "geometric": f"ORB keypoints, RANSAC similarity with >= {config.dedup_min_inliers} inliers; "
            "within one source and patient kept (a possible follow-up)"
            if config.dedup_min_inliers and config.dedup_max_distance >= 0
            else "off",
            "label_conflicts": config.dedup_label_conflicts,
            "keep": "lowest source priority, then source name, then record id",
            "priority": {name: dedup_priority(name) for name in config.sources},
        },
        "tables": {"splits": SPLIT_TABLE, "dropped": DROPPED_TABLE, "duplicates": DUPLICATE_TABLE},
        "shards": [{k: r[k] for k in ("file", "split", "records", "sha256")} for r in receipts],
        "data_config": config.recorded(),
    }
