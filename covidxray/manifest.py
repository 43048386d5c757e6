"""manifest.json: the one commit point of a prepared data set, sealed and checked; the data folder's file names.

Contract: `open_prepared(data_dir)` reads manifest.json once and returns a `PreparedData` (the folder, its `Manifest`
and `dataset_id`), or raises a UserError saying what to do; a command opens it once and hands it on, and
`PreparedData.shards(split)` lists a split's shard files from that one reading. `write_manifest` is the one writer
(prepare). `Manifest` is a frozen dataclass loaded with the config's strict coercion (covidxray/strict.py), with one
`SplitSummary` per split and one `ShardEntry` per shard. Every file name of a data folder is spelled here, as
run_folder.py does for run folders. Imports only the standard library and covidxray's own light modules, so a
training rank that only reads the manifest loads nothing else.

Shards are named after their content (`<split>-<i>-of-<n>-<fingerprint>.tfrecord`),
so a re-prepare writes its shards beside the old ones and only then replaces
manifest.json in one atomic rename. A reader that loaded a manifest reads the
shards it lists, which stay in place until the next prepare after that (the
previous set is kept), so it sees the old complete set or the new complete
set, never a mix; a re-prepare that is interrupted or runs out of disk leaves
the old manifest and every shard it lists untouched.

The manifest carries the sha256 of its own canonical content (every other key,
as sorted compact JSON), so an edit (other or reordered labels, a changed
shard list) is refused by everything that loads it, and `doctor` flags it.
Each shard's sha256 is in the manifest too: `shard_problems` checks files
against it before training, `require_intact_shards` before export and evaluate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from covidxray.errors import UserError
from covidxray.files import atomic_write, json_sha256, sha256_file
from covidxray.strict import ConfigError, foreign_version, from_dict, setting

if TYPE_CHECKING:
    from covidxray.run_folder import ModelCard

MANIFEST = "manifest.json"
SHARD_DIR = "shards"
RAW_DIR = "raw"  # what the sources' downloads and extractions are kept in
CACHE_DIR = "cache"  # the decode cache (covidxray/data/image_cache.py)
CHECKSUM = "checksum"
SPLIT_TABLE = "splits.csv"  # every kept image, its patient and its split: the audit trail of the split
DROPPED_TABLE = "dropped.csv"  # every row or file not used, and why
DUPLICATE_TABLE = "duplicates.csv"  # every removed copy and the image kept in its place
TABLES = (SPLIT_TABLE, DROPPED_TABLE, DUPLICATE_TABLE)
TABLE_SHA256 = "table_sha256"  # table name -> sha256 of the table written with this manifest
SPLITS = ("train", "val", "test")
FORMAT = "covidxray-shards/1"  # the manifest's version: a reader refuses any other
_SHARD_FILE = re.compile(r"^[\w.-]+\.tfrecord$")  # a plain name inside shards/: no folder, no '..'
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_IDENTITY = ("task", "labels", "image_size", "preprocessing", "shards")  # what training reads: see dataset_id
_RERUN = "re-run `covidxray prepare` with the same config and --data-dir (decodes are cached and intact shards reused, so it is quick)"


@dataclass(frozen=True)
class SplitSummary:
    records: int = setting(low=0)
    patients: int = setting(0, low=0)
    classes: dict[str, int] = setting(default_factory=dict, low=0)
    sources: dict[str, int] = setting(default_factory=dict, low=0)
    source_classes: dict[str, dict[str, int]] = setting(default_factory=dict, low=0)


@dataclass(frozen=True)
class ShardEntry:
    file: str
    split: str = setting(choices=SPLITS)
    records: int = setting(low=0)
    sha256: str = ""


@dataclass(frozen=True)
class Manifest:
    """manifest.json as prepare wrote it (covidxray/data/prepare.py build_manifest); the fields after `shards` are
    the record of how the set was made, read by the report and `doctor`."""

    task: str
    labels: list[str]
    image_size: int = setting(low=16, high=4096)
    splits: dict[str, SplitSummary] = field(default_factory=dict)
    shards: list[ShardEntry] = field(default_factory=list)
    format: str = FORMAT
    preprocessing: int | None = None
    harmonise: str = "none"  # a set prepared before harmonisation existed is plain
    data_config: dict[str, Any] = field(default_factory=dict)
    table_sha256: dict[str, str] = field(default_factory=dict)
    patient_disjoint: bool | None = None
    composition: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, Any] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    dropped_total: int = 0
    duplicates_removed: dict[str, Any] = field(default_factory=dict)
    dedup: dict[str, Any] = field(default_factory=dict)
    tables: dict[str, str] = field(default_factory=dict)
    split: dict[str, Any] = field(default_factory=dict)
    shards_reused: int = 0
    seconds: float = 0.0
    checksum: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """As plain JSON data: for a manifest prepare wrote, exactly the content of manifest.json."""
        return dataclasses.asdict(self)

    @property
    def composition_warnings(self) -> list[str]:
        return list(self.composition.get("warnings", []))


def canonical_sha256(manifest: dict) -> str:
    """sha256 over every key but the checksum itself."""
    return json_sha256({k: v for k, v in manifest.items() if k != CHECKSUM})


def seal(manifest: dict) -> dict:
    return {
        **manifest,
        CHECKSUM: {"sha256": canonical_sha256(manifest), "over": "sorted compact JSON of every other key"},
    }


def write_manifest(data_dir: Path, manifest: dict) -> Manifest:
    """Seal and write atomically (this rename is the moment the new data set becomes the data set); returns it
    loaded as every reader loads it, so a manifest no reader would accept is never written."""
    sealed = seal(manifest)
    loaded = _parse(sealed, Path(data_dir) / MANIFEST)
    atomic_write(Path(data_dir) / MANIFEST, json.dumps(sealed, indent=2))
    return loaded


def _parse(content: Any, path: Path) -> Manifest:
    """The Manifest in `content` (manifest.json's JSON) if it is intact and unedited; UserError naming what is wrong."""
    if not isinstance(content, dict) or not isinstance(content.get("shards"), list):
        raise UserError(f"{path} is not a covidxray manifest (no shard list); {_RERUN}")
    # A file without the version field was written by a covidxray from before it was added, in this same layout:
    # version 1. Its checksum (below) still proves it is prepare's own, unedited.
    version = foreign_version(content, "format", FORMAT)
    if version is not None:
        raise UserError(
            f"{path} is a data set of format {version!r}, written by another version of covidxray; this one reads "
            f"{FORMAT!r}: use the covidxray that prepared it, or {_RERUN}"
        )
    sealed = content.get(CHECKSUM)
    if not isinstance(sealed, dict) or "sha256" not in sealed:
        raise UserError(f"{path} carries no checksum (written by an older covidxray, or edited); {_RERUN}")
    if sealed["sha256"] != canonical_sha256(content):
        raise UserError(
            f"{path} was changed after prepare wrote it (its content no longer matches its checksum), so its labels "
            f"and shard list cannot be trusted; restore it, or {_RERUN}"
        )
    # Keys an older prepare wrote and this one no longer does (e.g. "errors", "skipped") are left out, not refused:
    # the checksum above already proves the file is prepare's own. The checksum is no signature, though (anyone can
    # reseal an edited file), so every field readers use is checked for its type and range.
    known = {f.name for f in dataclasses.fields(Manifest)}
    try:
        manifest = from_dict(Manifest, {k: v for k, v in content.items() if k in known}, "manifest")
    except ConfigError as err:
        raise UserError(f"{path} is not a covidxray manifest ({err}); {_RERUN}") from None
    problem = _structure_problem(manifest)
    if problem:
        raise UserError(f"{path} is not a covidxray manifest ({problem}); {_RERUN}")
    return manifest


def _structure_problem(manifest: Manifest) -> str | None:
    """What the types alone do not say (every split present, shard names that stay in shards/), or None."""
    if not manifest.labels:
        return "labels is not a list of class names"
    for split in SPLITS:
        if split not in manifest.splits:
            return f"splits.{split} is missing"
    for i, shard in enumerate(manifest.shards):
        if not (_SHARD_FILE.match(shard.file) and _SHA256.match(shard.sha256)):
            return f"shards[{i}] is not a shard file name in {SHARD_DIR}/ with its split, record count and sha256"
    if not all(name in TABLES and _SHA256.match(sha) for name, sha in manifest.table_sha256.items()):
        return f"{TABLE_SHA256} does not map {', '.join(TABLES)} to sha256s"
    return None


@dataclass(frozen=True)
class PreparedData:
    """A prepared data set as one command sees it: read once, so every step of the command uses the same set even
    if a `prepare` replaces manifest.json meanwhile (the shards it lists stay until the prepare after that)."""

    path: Path
    manifest: Manifest
    dataset_id: str  # sha256 of what training reads (task, labels, size, preprocessing, every shard's sha256)
    file_sha256: str  # of manifest.json's bytes: only to recognise a model card written before dataset_id existed

    def shards(self, split: str) -> list[Path]:
        return [self.path / SHARD_DIR / s.file for s in self.manifest.shards if s.split == split and s.records]

    def table(self, name: str) -> Path:
        if name not in TABLES:
            raise ValueError(f"{name} is not one of the data folder's tables {TABLES}")
        return self.path / name

    def is_training_data_of(self, card: ModelCard) -> bool:
        """Whether this is the very data set the model (its card) was trained on."""
        if card.dataset_id is not None:
            return card.dataset_id == self.dataset_id
        return card.manifest_sha256 == self.file_sha256  # a card from before dataset_id named the file's bytes


def open_prepared(data_dir: str | Path) -> PreparedData:
    """The prepared data set in `data_dir`, its manifest read once; UserError when there is none or it is damaged."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise UserError(f"{path} not found: run `covidxray prepare` first (or point --data-dir at prepared data)")
    try:
        raw = path.read_bytes()
        content = json.loads(raw)
    except ValueError as err:
        raise UserError(f"{path} is damaged (truncated or not JSON: {err}); {_RERUN}") from None
    except OSError as err:
        raise UserError(f"cannot read {path} ({err.strerror or err}); check its permissions") from None
    except RecursionError:
        raise UserError(f"{path} is not a covidxray manifest (nested too deeply); {_RERUN}") from None
    manifest = _parse(content, path)
    # dataset_id is over the content as written, so it equals the `data_sha256` of run_inputs.json files that
    # earlier versions wrote (a resume across the upgrade still matches).
    dataset_id = json_sha256({k: content.get(k) for k in _IDENTITY})
    return PreparedData(Path(data_dir), manifest, dataset_id, hashlib.sha256(raw).hexdigest())


def check_model_matches(card: ModelCard, data: PreparedData) -> bool:
    """Whether `data` is the very data set the model (its card) was trained on.

    UserError when its labels or image size differ from the model's: the model cannot be measured on it.
    """
    manifest = data.manifest
    if manifest.labels != card.labels or manifest.image_size != card.image_size:
        raise UserError(
            f"{data.path} holds labels {manifest.labels} at {manifest.image_size} px but the model was trained on "
            f"labels {card.labels} at {card.image_size} px: point --data-dir at the data it was trained on "
            f"(or prepare data of task {card.task or '?'} with --image-size {card.image_size})"
        )
    return data.is_training_data_of(card)


def shard_problems(data: PreparedData, files: list[str] | None = None) -> dict[str, list[str]]:
    """{"missing": [...], "sha256_mismatch": [...]} for the manifest's shards (or just `files`, by name)."""
    wanted = None if files is None else {Path(f).name for f in files}
    missing, mismatched = [], []
    for shard in data.manifest.shards:
        if wanted is not None and shard.file not in wanted:
            continue
        path = data.path / SHARD_DIR / shard.file
        if not path.is_file():
            missing.append(shard.file)
        elif sha256_file(path) != shard.sha256:
            mismatched.append(shard.file)
    return {"missing": missing, "sha256_mismatch": mismatched}


def describe_shard_problems(data_dir: str | Path, problems: dict[str, list[str]]) -> str:
    parts = []
    if problems["sha256_mismatch"]:
        parts.append(f"damaged (sha256 differs from {MANIFEST}): {', '.join(problems['sha256_mismatch'])}")
    if problems["missing"]:
        parts.append(f"missing: {', '.join(problems['missing'])}")
    return (
        f"shards in {Path(data_dir) / SHARD_DIR} {'; '.join(parts)}. Re-run `covidxray prepare` with the same config to "
        "repair them (intact shards are kept), or copy them again from the machine that prepared them"
    )


def require_intact_shards(data: PreparedData, splits: tuple[str, ...]) -> None:
    """UserError naming every shard of `splits` that is missing or whose sha256 differs from the manifest's.

    For the commands that read a whole split (export, evaluate); `train` checks each rank's own shards
    with the same `shard_problems`.
    """
    files = [shard.file for shard in data.manifest.shards if shard.split in splits and shard.records]
    problems = shard_problems(data, files)
    if problems["missing"] or problems["sha256_mismatch"]:
        raise UserError(describe_shard_problems(data.path, problems))
