"""Leak audit: the same image, or the same patient, in two splits.

`covidxray audit DATA_DIR` checks either a data set `prepare` wrote (its
splits.csv says which image and patient went where) or any folder tree with
one split per top-level folder (the Kaggle set's own `train/` and `test/`),
whose patients come from the file-name schemes the source adapters know.
Copies are found by the same matching `prepare` dedups with (exact pixels,
perceptual hash, geometric check), and `prepare` runs the check on its own
split before it writes a manifest.

An audit that could not read every image says so and fails: a clean result
over a fraction of the set would be a false all-clear. Images that were read
but are not radiographs (prepare would drop them too) are only counted.
splits.csv holds absolute paths (older versions wrote them as given to
prepare, relative to the folder it ran in) and must be the one the live
manifest records.
"""

from __future__ import annotations

import csv
import os
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from covidxray.config import DataConfig
from covidxray.data import dedup
from covidxray.data.image_cache import ImageCache, cache_path
from covidxray.errors import UserError
from covidxray.files import sha256_file
from covidxray.manifest import MANIFEST, SPLIT_TABLE, open_prepared
from covidxray.records import Record
from covidxray.sources import covid19_talo, zhanglab
from covidxray.sources.layout import is_junk, list_images, subdirs, unreadable

SPLIT_COLUMNS = ("split", "patient_id", "source", "label", "image")
NOT_RADIOGRAPHS = frozenset({"not-xray", "not-radiograph"})  # read fine, judged unusable: nothing to compare


@dataclass(frozen=True)
class Leak:
    kind: str  # "patient" (one patient id in several splits) or a match kind ("exact", "perceptual", "geometric")
    splits: tuple[str, str]
    first: str  # image (or, for a patient, the patient id)
    second: str
    evidence: str

    def line(self) -> str:
        if self.kind == "patient":
            return f"patient {self.first} is in {self.splits[0]} and {self.splits[1]} ({self.evidence})"
        return f"{self.kind} copy: {self.first} ({self.splits[0]}) = {self.second} ({self.splits[1]}): {self.evidence}"


def find_leaks(split_of: dict[tuple[str, str], str], records: Iterable[Record], matches) -> list[Leak]:
    """Leaks among `records` whose split is split_of[(source, image)]; `matches` as in dedup.DedupResult.matches."""
    leaks = []
    where: dict[str, dict[str, str]] = defaultdict(dict)  # patient -> split -> an image of it there
    for record in records:
        split = split_of.get((record.source, str(record.image)))
        if split is not None:
            where[record.patient_id].setdefault(split, str(record.image))
    for patient, images in sorted(where.items()):
        splits = sorted(images)
        for other in splits[1:]:
            leaks.append(
                Leak("patient", (splits[0], other), patient, "", f"e.g. {images[splits[0]]} and {images[other]}")
            )
    for first, second, kind, evidence in matches:
        a, b = split_of.get((first.source, str(first.image))), split_of.get((second.source, str(second.image)))
        if a is not None and b is not None and a != b:
            leaks.append(Leak(kind, (a, b), str(first.image), str(second.image), evidence))
    return leaks


def patient_from_name(path: Path) -> str | None:
    """The patient a public file-name scheme encodes (Zhang lab / Kaggle, NIH, ieee8023 via the shipped table), or None."""
    if parsed := zhanglab.parse_name(path.stem):
        return f"zhanglab:{parsed[0]}"
    return covid19_talo.known_patient(path.name)


def _tree_records(root: Path) -> list[Record]:
    records = []
    splits = subdirs(root)
    if len(splits) < 2:
        raise UserError(
            f"{root}: neither a prepared data set (no {SPLIT_TABLE}) nor a tree with one split per top-level folder (found {len(splits)} folder(s))"
        )

    def refuse(err: OSError) -> None:  # os.walk would skip an unreadable folder without a word
        raise unreadable(err) if isinstance(err, PermissionError) else UserError(f"cannot read {err.filename}: {err}")

    for split_dir in splits:
        for folder, names, _ in os.walk(split_dir, onerror=refuse):
            names[:] = sorted(n for n in names if not is_junk(Path(n)))
            for item in list_images(Path(folder)):
                if isinstance(item, Path):
                    patient = patient_from_name(item) or f"file:{item}"  # unknown scheme: every file its own patient
                    records.append(Record(image=item, label="", patient_id=patient, source=split_dir.name))
    return records


def _prepared_records(data_dir: Path) -> tuple[list[Record], dict[tuple[str, str], str]]:
    table = data_dir / SPLIT_TABLE
    if (data_dir / MANIFEST).is_file():
        recorded = open_prepared(data_dir).manifest.table_sha256.get(SPLIT_TABLE)
        if recorded is not None and recorded != sha256_file(table):
            raise UserError(
                f"{table} is not the one {data_dir / MANIFEST} records (prepare was stopped right after switching the "
                "data set, or the file was edited); re-run `covidxray prepare` with the same config to rewrite it"
            )
    records, split_of = [], {}
    try:
        with open(table, newline="", encoding="utf-8", errors="surrogateescape") as handle:
            reader = csv.DictReader(handle)
            missing = [c for c in SPLIT_COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise UserError(
                    f"{table} has no column(s) {', '.join(missing)}; it is not a {SPLIT_TABLE} prepare wrote"
                )
            for row in reader:
                if any(row.get(c) is None for c in SPLIT_COLUMNS):
                    raise UserError(f"{table} line {reader.line_num}: fewer fields than the header names")
                record = Record(
                    image=Path(row["image"]), label=row["label"], patient_id=row["patient_id"], source=row["source"]
                )
                records.append(record)
                split_of[(record.source, row["image"])] = row["split"]
    except csv.Error as err:
        raise UserError(f"{table}: malformed CSV ({err}); re-run `covidxray prepare` to rewrite it") from None
    return records, split_of


def _incomplete(records: list[Record], decoded: dict, leaks: list[Leak]) -> UserError:
    """The error of an audit that could not compare every image: how many, why, and what it found among the rest."""
    unread = [
        r for r in records if not decoded[str(r.image)].ok and decoded[str(r.image)].reason not in NOT_RADIOGRAPHS
    ]
    reasons = Counter(decoded[str(r.image)].reason for r in unread)
    example = unread[0]
    relative = [r for r in unread if not r.image.is_absolute()]
    hint = (
        f" {len(relative)} of them have paths relative to the folder prepare ran in (written by an older covidxray): "
        "run audit from that folder, or re-run prepare, which now records absolute paths."
        if relative
        else " Restore or make them readable, then audit again."
    )
    found = f"; among the rest, {len(leaks)} leak(s): " + "; ".join(leak.line() for leak in leaks[:5]) if leaks else ""
    return UserError(
        f"{len(unread)} of {len(records)} image(s) could not be read, so the audit is incomplete "
        f"({', '.join(f'{n} {reason}' for reason, n in reasons.most_common())}; e.g. {example.image}: "
        f"{decoded[str(example.image)].detail}).{hint}{found}"
    )


def audit(
    data_dir: Path, config: DataConfig, progress: Callable[..., None] | None = None, log: Callable[[str], None] = print
) -> list[Leak]:
    """Every leak in a prepared data set or a split-per-folder tree; decodes through the data set's cache when it has one."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise UserError(f"{data_dir} is not a folder")
    progress = progress or (lambda done, total=None: None)
    prepared = (data_dir / SPLIT_TABLE).is_file()
    if prepared:
        records, split_of = _prepared_records(data_dir)
    else:
        records = _tree_records(data_dir)
        split_of = {(r.source, str(r.image)): r.source for r in records}
    log(f"auditing {len(records)} image(s) in {len({s for s in split_of.values()})} split(s) of {data_dir}")
    with tempfile.TemporaryDirectory() as scratch:
        cache_file = cache_path(data_dir if prepared else Path(scratch), config.image_size)
        with ImageCache(cache_file, log) as cache:
            decoded, _ = cache.decode_configured([str(r.image) for r in records], config, progress, log)
    usable = [r for r in records if decoded[str(r.image)].ok]
    judged = sum(decoded[str(r.image)].reason in NOT_RADIOGRAPHS for r in records)
    if judged:
        log(f"{judged} file(s) were read but are not radiographs (prepare drops them too): not compared")
    hashes = {str(r.image): (decoded[str(r.image)].pixel_sha256, decoded[str(r.image)].phash) for r in usable}
    features = {str(r.image): decoded[str(r.image)].features for r in usable}
    edges = dedup.matches(usable, hashes, features, config.dedup_max_distance, config.dedup_min_inliers)
    found = [(usable[i], usable[j], kind, evidence) for i, j, kind, _, evidence in edges]
    leaks = find_leaks(split_of, records, found)
    if len(usable) + judged < len(records):
        raise _incomplete(records, decoded, leaks)
    return leaks
