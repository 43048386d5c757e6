"""`covidxray prepare`: sources -> harmonised, deduplicated, patient-split, sharded TFRecords.

Shards are planned up front from the sorted record list, so the plan (and
every shard's bytes) depends only on the inputs and the config. Each finished
shard gets a small JSON receipt; a re-run or a resumed run skips shards whose
receipt matches the plan, which makes a killed run cheap to restart and
yields identical shards.
"""

from __future__ import annotations

import csv
import hashlib
import json
import multiprocessing
import os
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from covidxray.config import DataConfig
from covidxray.data import preprocess
from covidxray.errors import UserError
from covidxray.data.labels import Task, get_task
from covidxray.data.split import SPLITS, patients_overlap, split_by_patient
from covidxray.sources import Dropped, Record, build_source

MANIFEST = "manifest.json"
SPLIT_TABLE = "splits.csv"  # every kept image, its patient and its split: the audit trail of the split
Progress = Callable[..., None]  # progress(done, total=None)


def collect_records(config: DataConfig, task: Task, cache_dir: Path) -> tuple[list[Record], Counter]:
    records: list[Record] = []
    dropped: Counter = Counter()
    for name, options in config.sources.items():
        source = build_source(name, options)
        root = source.fetch(cache_dir / name)
        for item in source.records(root):
            if isinstance(item, Dropped):
                dropped[f"{name}: {item.reason}"] += 1
            elif task.class_of(item.label) is None:
                dropped[f"{name}: label {item.label!r} not in task {task.name}"] += 1
            else:
                records.append(item)
    return records, dropped


def plan_shards(splits: dict[str, list[Record]], records_per_shard: int) -> list[tuple[str, list[Record]]]:
    plan = []
    for split in SPLITS:
        records = splits[split]
        count = max(1, -(-len(records) // records_per_shard)) if records else 0
        for i in range(count):
            chunk = records[i * len(records) // count : (i + 1) * len(records) // count]
            plan.append((f"{split}-{i:05d}-of-{count:05d}.tfrecord", chunk))
    return plan


def _fingerprint(records: list[Record], task: Task, image_size: int) -> str:
    digest = hashlib.sha256(f"{task.name}|{image_size}|".encode())
    for r in records:
        digest.update(f"{r.record_id}|{r.image}|{r.label}\n".encode())
    return digest.hexdigest()


def _decode_one(job: tuple[str, int]) -> tuple[bytes | None, str, str]:
    """Worker: file -> resized PNG bytes, or (None, reason, message)."""
    path, size = job
    try:
        return preprocess.encode_png(preprocess.resize_square(preprocess.load_gray(path), size)), "", ""
    except preprocess.ImageError as err:
        return None, err.reason, str(err)


def _write_shard(path: Path, records: list[Record], task: Task, size: int, pool, fingerprint: str, progress: Progress) -> dict:
    from covidxray.data import tfrecord

    classes: Counter = Counter()
    sources: Counter = Counter()
    skipped: Counter = Counter()
    errors: list[str] = []

    def examples():
        jobs = [(str(r.image), size) for r in records]
        for record, (png, reason, message) in zip(records, pool.imap(_decode_one, jobs, chunksize=8)):
            progress(1)
            if png is None:
                skipped[f"{record.source}: image {reason}"] += 1
                errors.append(message)
                continue
            classes[task.class_of(record.label)] += 1
            sources[record.source] += 1
            yield tfrecord.make_example(png, task.index_of(record.label), record.patient_id, record.source, record.record_id)

    written = tfrecord.write_shard(path, examples())
    receipt = {
        "file": path.name,
        "split": path.name.split("-")[0],
        "fingerprint": fingerprint,
        "records": written,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "classes": dict(classes),
        "sources": dict(sources),
        "patients": len({r.patient_id for r in records}),
        "skipped": dict(skipped),
        "errors": errors[:20],
    }
    tmp = path.with_suffix(".json.partial")
    tmp.write_text(json.dumps(receipt, indent=1))
    os.replace(tmp, path.with_suffix(".json"))
    return receipt


def write_split_table(path: Path, splits: dict[str, list[Record]], task: Task) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["split", "patient_id", "source", "label", "class", "view", "image"])
        for split in SPLITS:
            for r in splits[split]:
                writer.writerow([split, r.patient_id, r.source, r.label, task.class_of(r.label), r.view, str(r.image)])
    os.replace(tmp, path)


def _receipt_if_done(path: Path, fingerprint: str) -> dict | None:
    receipt_path = path.with_suffix(".json")
    if not (path.is_file() and receipt_path.is_file()):
        return None
    receipt = json.loads(receipt_path.read_text())
    return receipt if receipt.get("fingerprint") == fingerprint else None


def prepare(config: DataConfig, progress: Progress | None = None, log: Callable[[str], None] = print) -> dict:
    """Run the whole preparation; returns the manifest it wrote."""
    started = time.time()
    task = get_task(config.task)
    out = Path(config.data_dir)
    shard_dir = out / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)

    records, dropped = collect_records(config, task, out / "raw")
    if not records:
        raise UserError(f"no usable records for task {task.name} in sources {', '.join(config.sources)}")
    splits = split_by_patient(records, task, config.val_fraction, config.test_fraction, config.seed)
    overlap = patients_overlap(splits)
    if overlap:
        raise AssertionError(f"patient split is unsound: {overlap[:5]} in several splits")
    write_split_table(out / SPLIT_TABLE, splits, task)
    plan = plan_shards(splits, config.records_per_shard)
    planned = {name for name, _ in plan}
    for stale in shard_dir.iterdir():  # shards of an earlier, different plan
        if stale.name.endswith(".partial") or stale.name.split(".")[0] + ".tfrecord" not in planned:
            stale.unlink()

    progress = progress or (lambda done, total=None: None)
    progress(0, sum(len(chunk) for _, chunk in plan))
    workers = config.workers or os.cpu_count() or 1
    receipts, reused = [], 0
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        for name, chunk in plan:
            path = shard_dir / name
            fingerprint = _fingerprint(chunk, task, config.image_size)
            receipt = _receipt_if_done(path, fingerprint)
            if receipt is None:
                receipt = _write_shard(path, chunk, task, config.image_size, pool, fingerprint, progress)
            else:
                reused += 1
                progress(len(chunk))
            receipts.append(receipt)

    manifest = build_manifest(config, task, splits, receipts, dropped)
    manifest["shards_reused"] = reused
    manifest["seconds"] = round(time.time() - started, 2)
    tmp = out / (MANIFEST + ".partial")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / MANIFEST)
    return manifest


def build_manifest(config: DataConfig, task: Task, splits, receipts: list[dict], dropped: Counter) -> dict:
    skipped: Counter = Counter(dropped)
    per_split: dict[str, dict] = {}
    for split in SPLITS:
        mine = [r for r in receipts if r["split"] == split]
        classes: Counter = Counter()
        sources: Counter = Counter()
        for receipt in mine:
            classes.update(receipt["classes"])
            sources.update(receipt["sources"])
            skipped.update(receipt["skipped"])
        per_split[split] = {
            "records": sum(r["records"] for r in mine),
            "patients": len({rec.patient_id for rec in splits[split]}),
            "classes": {c: classes.get(c, 0) for c in task.classes},
            "sources": dict(sorted(sources.items())),
        }
    return {
        "format": "covidxray-shards/1",
        "task": task.name,
        "labels": list(task.classes),
        "image_size": config.image_size,
        "preprocessing": preprocess.PREPROCESSING,
        "splits": per_split,
        "patient_disjoint": True,
        "dropped": dict(sorted(skipped.items())),
        "shards": [{k: r[k] for k in ("file", "split", "records", "sha256")} for r in receipts],
        "data_config": asdict(config),
    }


def load_manifest(data_dir: str | Path) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise UserError(f"{path} not found: run `covidxray prepare` first (or point --data-dir at prepared data)")
    return json.loads(path.read_text())


def manifest_sha256(data_dir: str | Path) -> str:
    return hashlib.sha256((Path(data_dir) / MANIFEST).read_bytes()).hexdigest()


def shard_paths(data_dir: str | Path, split: str) -> list[Path]:
    manifest = load_manifest(data_dir)
    return [Path(data_dir) / "shards" / s["file"] for s in manifest["shards"] if s["split"] == split and s["records"]]
