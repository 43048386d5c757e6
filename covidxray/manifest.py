"""manifest.json: the one commit point of a prepared data set, sealed and checked.

Contract: `load_manifest(data_dir)` returns the manifest prepare wrote, intact
and unedited, or raises a UserError saying what to do; `shard_paths` lists
the shard files of one split; `manifest_sha256` names the exact data set a
model was trained on, and `check_model_matches` compares a model card with it.
Imports only the standard library and covidxray's own light modules, so a
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

import json
import re
from pathlib import Path

from covidxray.errors import UserError
from covidxray.files import atomic_write, json_sha256, sha256_file

MANIFEST = "manifest.json"
SHARD_DIR = "shards"
CHECKSUM = "checksum"
SPLIT_TABLE = "splits.csv"  # every kept image, its patient and its split: the audit trail of the split
DROPPED_TABLE = "dropped.csv"  # every row or file not used, and why
DUPLICATE_TABLE = "duplicates.csv"  # every removed copy and the image kept in its place
TABLES = (SPLIT_TABLE, DROPPED_TABLE, DUPLICATE_TABLE)
TABLE_SHA256 = "table_sha256"  # table name -> sha256 of the table written with this manifest
SPLITS = ("train", "val", "test")
_SHARD_FILE = re.compile(r"^[\w.-]+\.tfrecord$")  # a plain name inside shards/: no folder, no '..'
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_RERUN = "re-run `covidxray prepare` with the same config and --data-dir (decodes are cached and intact shards reused, so it is quick)"


def canonical_sha256(manifest: dict) -> str:
    """sha256 over every key but the checksum itself."""
    return json_sha256({k: v for k, v in manifest.items() if k != CHECKSUM})


def content_sha256(manifest: dict) -> str:
    """sha256 of what training reads (task, labels, image size, preprocessing, every shard's sha256), not of
    run details such as the time prepare took: a re-prepare of the same data keeps it."""
    return json_sha256({k: manifest.get(k) for k in ("task", "labels", "image_size", "preprocessing", "shards")})


def seal(manifest: dict) -> dict:
    return {
        **manifest,
        CHECKSUM: {"sha256": canonical_sha256(manifest), "over": "sorted compact JSON of every other key"},
    }


def write_manifest(data_dir: Path, manifest: dict) -> dict:
    """Seal and write atomically (this rename is the moment the new data set becomes the data set); returns it sealed."""
    sealed = seal(manifest)
    atomic_write(Path(data_dir) / MANIFEST, json.dumps(sealed, indent=2))
    return sealed


def read_manifest(path: Path) -> dict:
    """The manifest at `path` if it is intact and unedited; UserError naming what is wrong otherwise."""
    try:
        manifest = json.loads(path.read_bytes())
    except ValueError as err:
        raise UserError(f"{path} is damaged (truncated or not JSON: {err}); {_RERUN}") from None
    except OSError as err:
        raise UserError(f"cannot read {path} ({err.strerror or err}); check its permissions") from None
    except RecursionError:
        raise UserError(f"{path} is not a covidxray manifest (nested too deeply); {_RERUN}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
        raise UserError(f"{path} is not a covidxray manifest (no shard list); {_RERUN}")
    sealed = manifest.get(CHECKSUM)
    if not isinstance(sealed, dict) or "sha256" not in sealed:
        raise UserError(f"{path} carries no checksum (written by an older covidxray, or edited); {_RERUN}")
    if sealed["sha256"] != canonical_sha256(manifest):
        raise UserError(
            f"{path} was changed after prepare wrote it (its content no longer matches its checksum), so its labels "
            f"and shard list cannot be trusted; restore it, or {_RERUN}"
        )
    problem = _structure_problem(manifest)
    if problem:  # the checksum is no signature: anyone can reseal an edited file
        raise UserError(f"{path} is not a covidxray manifest ({problem}); {_RERUN}")
    return manifest


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _structure_problem(manifest: dict) -> str | None:
    """What is wrong with the fields readers use (types, shard names that stay in shards/), or None."""
    labels = manifest.get("labels")
    if not (isinstance(labels, list) and labels and all(isinstance(x, str) for x in labels)):
        return "labels is not a list of class names"
    if not isinstance(manifest.get("task"), str):
        return "task is not a name"
    if not (_count(manifest.get("image_size")) and 16 <= manifest["image_size"] <= 4096):
        return "image_size is not a size in pixels"
    splits = manifest.get("splits")
    for split in SPLITS:
        info = splits.get(split) if isinstance(splits, dict) else None
        if not (isinstance(info, dict) and _count(info.get("records"))):
            return f"splits.{split}.records is not a count"
        for key in ("classes", "sources"):
            counts = info.get(key, {})
            if not (isinstance(counts, dict) and all(_count(n) for n in counts.values())):
                return f"splits.{split}.{key} is not a table of counts"
    for i, shard in enumerate(manifest["shards"]):
        if not (
            isinstance(shard, dict)
            and isinstance(shard.get("file"), str)
            and _SHARD_FILE.match(shard["file"])
            and shard.get("split") in SPLITS
            and _count(shard.get("records"))
            and isinstance(shard.get("sha256"), str)
            and _SHA256.match(shard["sha256"])
        ):
            return f"shards[{i}] is not a shard file name in {SHARD_DIR}/ with its split, record count and sha256"
    if not isinstance(manifest.get("data_config", {}), dict):
        return "data_config is not a mapping"
    tables = manifest.get(TABLE_SHA256, {})
    if not (
        isinstance(tables, dict)
        and all(name in TABLES and isinstance(sha, str) and _SHA256.match(sha) for name, sha in tables.items())
    ):
        return f"{TABLE_SHA256} does not map {', '.join(TABLES)} to sha256s"
    return None


def load_manifest(data_dir: str | Path) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise UserError(f"{path} not found: run `covidxray prepare` first (or point --data-dir at prepared data)")
    return read_manifest(path)


def manifest_sha256(data_dir: str | Path) -> str:
    """sha256 of manifest.json's bytes: the model card's name for the exact data set it was trained on."""
    return sha256_file(Path(data_dir) / MANIFEST)


def shard_paths(data_dir: str | Path, split: str) -> list[Path]:
    manifest = load_manifest(data_dir)
    return [Path(data_dir) / SHARD_DIR / s["file"] for s in manifest["shards"] if s["split"] == split and s["records"]]


def check_model_matches(card: dict, data_dir: str | Path) -> tuple[dict, bool]:
    """The manifest of `data_dir` and whether it is the very data set the model (its card) was trained on.

    UserError when its labels or image size differ from the model's: the model cannot be measured on it.
    """
    manifest = load_manifest(data_dir)
    if manifest["labels"] != card["labels"] or int(manifest["image_size"]) != int(card["image_size"]):
        raise UserError(
            f"{data_dir} holds labels {manifest['labels']} at {manifest['image_size']} px but the model was trained on "
            f"labels {card['labels']} at {card['image_size']} px: point --data-dir at the data it was trained on "
            f"(or prepare data of task {card.get('task', '?')} with --image-size {card['image_size']})"
        )
    return manifest, manifest_sha256(data_dir) == card.get("manifest_sha256")


def shard_problems(data_dir: str | Path, manifest: dict, files: list[str] | None = None) -> dict[str, list[str]]:
    """{"missing": [...], "sha256_mismatch": [...]} for the manifest's shards (or just `files`, by name)."""
    wanted = None if files is None else {Path(f).name for f in files}
    missing, mismatched = [], []
    for shard in manifest["shards"]:
        if wanted is not None and shard["file"] not in wanted:
            continue
        path = Path(data_dir) / SHARD_DIR / shard["file"]
        if not path.is_file():
            missing.append(shard["file"])
        elif sha256_file(path) != shard["sha256"]:
            mismatched.append(shard["file"])
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


def require_intact_shards(data_dir: str | Path, manifest: dict, splits: tuple[str, ...]) -> None:
    """UserError naming every shard of `splits` that is missing or whose sha256 differs from the manifest's.

    For the commands that read a whole split (export, evaluate); `train` checks each rank's own shards
    with the same `shard_problems`.
    """
    files = [shard["file"] for shard in manifest["shards"] if shard["split"] in splits and shard["records"]]
    problems = shard_problems(data_dir, manifest, files)
    if problems["missing"] or problems["sha256_mismatch"]:
        raise UserError(describe_shard_problems(data_dir, problems))
