"""The run folder: what `train`, `evaluate` and `export` write into `train.run_dir`, and `predict` reads.

Contract: every file name of a run folder is spelled here and nowhere else.
Rank 0 of `train` holds RUN_LOCK while it runs and writes MODEL_FILE (the best Keras model), MODEL_CARD (a
`ModelCard`, written by `write_model_card` and read by `read_model_card`: what the model needs to be used: labels,
image size, preprocessing version, the data set's id), CONFIG_FILE, TRAIN_LOG and CHECKPOINTS/ with the LATEST
pointer, which is the commit point of a resumable run: it names a complete
checkpoint folder; unless train.tensorboard is false, also TENSORBOARD_DIR/. `export` writes SAVED_MODEL_DIR, one `tflite_name(fmt)`
plus its `sidecar_path` per format, and EXPORT_REPORT. `evaluate` writes
EVALUATION, and with `--external` one `external_copies_name(i)` table per
external data set (the images dropped as copies), and TEST_PREDICTIONS. `report` writes REPORT_FILE. The two
reports' types, writer and reader are in covidxray/reports.py; `read_versioned` is how every versioned JSON file
here is read. Every JSON file here is written atomically (`write_json`), so a reader sees the old or the new file.

Imports only the standard library and covidxray's own light modules.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from covidxray.errors import UserError
from covidxray.files import atomic_write
from covidxray.strict import ConfigError, foreign_version, from_dict, setting

MODEL_FILE = "model.keras"
MODEL_CARD = "model.json"
CONFIG_FILE = "config.yaml"
TRAIN_LOG = "train_log.json"
CHECKPOINTS = "checkpoints"
LATEST = "latest.json"  # in CHECKPOINTS: {"epoch", "path", ...} of the last complete checkpoint
RUN_LOCK = "train.lock"  # held by the running `train` (its host and pid inside); see covidxray/train/run_guard.py
EVALUATION = "evaluation.json"
SAVED_MODEL_DIR = "saved_model"
EXPORT_REPORT = "export_report.json"
CONVERTER_LOG = "export_converter.log"
TENSORBOARD_DIR = "tensorboard"  # rank 0's event files, one point per epoch (covidxray/train/tensorboard.py)
TEST_PREDICTIONS = "test_predictions.npz"  # evaluate: every test image's probabilities, in shard order
REPORT_FILE = "report.html"  # `covidxray report`: the run's model card (covidxray/report/)
DEFAULT_FORMAT = "float32"
CARD_VERSION = 1  # MODEL_CARD's layout: a reader refuses any other

T = TypeVar("T")


@dataclass(frozen=True)
class ModelCard:
    """MODEL_CARD: what the trained model needs to be used, with the effective values it was trained with (the
    prepared data set's, whatever the config said)."""

    labels: list[str]
    image_size: int = setting(low=16, high=4096)
    task: str | None = None
    model: str | None = None
    preprocessing: int | None = None
    harmonise: str = "none"  # predict makes its input like the shards' (edge/harmonise.py)
    dataset_id: str | None = None  # the training data's PreparedData.dataset_id
    manifest_sha256: str | None = None  # only in cards written before dataset_id: sha256 of manifest.json's bytes
    best: dict[str, Any] = field(default_factory=dict)  # the saved epoch's metrics
    # A card without the field was written before it existed, in this same layout: version 1.
    version: int = CARD_VERSION

    def to_json(self) -> dict[str, Any]:
        """The card as written: the legacy field only when it was read from an old card."""
        return {k: v for k, v in dataclasses.asdict(self).items() if not (k == "manifest_sha256" and v is None)}

    def sidecar_entries(self) -> dict[str, Any]:
        """What each exported model's sidecar carries over from the card (not the card's own version)."""
        return {k: v for k, v in self.to_json().items() if k != "version"}


def external_copies_name(index: int) -> str:
    """The table of external images `evaluate --external` dropped as copies of training images, per external set."""
    return f"external_copies_{index + 1}.csv"


def tflite_name(fmt: str) -> str:
    return f"model-{fmt}.tflite"


def sidecar_path(model_path: Path) -> Path:
    """The JSON beside a .tflite that says how to use it (labels, input size, temperature, ...)."""
    return model_path.with_suffix(".json")


def resolve_model(model: Path, fmt: str | None = None) -> Path:
    """`--model` is a .tflite or a run directory; in a directory `--format` picks the file."""
    if model.is_dir():
        return model / tflite_name(fmt or DEFAULT_FORMAT)
    if fmt and model.exists():  # a missing path is reported by the caller as "model not found"
        raise UserError(f"--format picks a model inside a run directory, but --model {model} already names one file")
    return model


def write_json(path: Path, payload: Any) -> None:
    atomic_write(path, json.dumps(payload, indent=2))


def write_latest(run_dir: Path, pointer: dict) -> None:
    """Commit a checkpoint: `pointer["path"]` names its complete folder in CHECKPOINTS, `pointer["epoch"]` its epoch."""
    write_json(Path(run_dir) / CHECKPOINTS / LATEST, pointer)


def read_latest(run_dir: Path) -> dict | None:
    """The last committed checkpoint pointer; None when there is none; UserError when it is damaged."""
    latest = Path(run_dir) / CHECKPOINTS / LATEST
    if not latest.is_file():
        return None
    try:
        saved = json.loads(latest.read_text())
    except ValueError as err:
        saved = f"not JSON: {err}"
    if not (isinstance(saved, dict) and isinstance(saved.get("path"), str) and isinstance(saved.get("epoch"), int)):
        detail = saved if isinstance(saved, str) else "no checkpoint path and epoch"
        raise UserError(
            f"{latest} is damaged ({detail}), so the last complete checkpoint is unknown; start over without "
            "--resume (the checkpoint folders beside it are not trusted without it)"
        )
    return saved


def write_model_card(run_dir: Path, card: ModelCard) -> None:
    write_json(Path(run_dir) / MODEL_CARD, card.to_json())


def read_model_card(run_dir: Path) -> ModelCard:
    """MODEL_CARD of a trained run (beside MODEL_FILE); UserError when the run has none, it is damaged or of
    another version."""
    run_dir = Path(run_dir)
    model_path, card_path = run_dir / MODEL_FILE, run_dir / MODEL_CARD
    if not model_path.is_file() or not card_path.is_file():
        raise UserError(f"no trained model in {run_dir} ({MODEL_FILE}, {MODEL_CARD}): run `covidxray train` first")
    return read_versioned(
        card_path,
        lambda content, where: from_dict(ModelCard, content, where),
        Versioned("a model card", CARD_VERSION, f"use the covidxray that trained it, or train again into {run_dir}"),
        f"train again into {run_dir}, or restore the file",
    )


@dataclass(frozen=True)
class Versioned:
    """How a reader of one kind of versioned JSON file names it and what it tells the user of a file of another
    version."""

    kind: str  # "a model card"
    current: int  # the version this covidxray writes and reads
    other_version: str  # what to do with a file of another version


def read_versioned(path: Path, parse: Callable[[dict[str, Any], str], T], versioned: Versioned, remedy: str) -> T:
    """`parse(content, where)` of the JSON object in `path`, where = the path (ConfigError names the key under it);
    a UserError naming the file when it is not JSON, not an object, of another version than `versioned.current`
    (a file without `version` was written before the field existed, in the first layout) or does not parse, with
    `remedy` (or `versioned.other_version`) saying what to do."""
    try:
        content = json.loads(path.read_bytes())
    except (ValueError, OSError, RecursionError) as err:
        content = f"{type(err).__name__}: {err}"
    if not isinstance(content, dict):
        detail = content if isinstance(content, str) else f"a JSON {type(content).__name__}, not an object"
        raise UserError(f"{path} is damaged ({detail}): {remedy}")
    version = foreign_version(content, "version", versioned.current)
    if version is not None:
        raise UserError(
            f"{path} is {versioned.kind} of version {version!r}, written by another version of covidxray; this one "
            f"reads version {versioned.current}: {versioned.other_version}"
        )
    try:
        return parse(content, str(path))
    except ConfigError as err:
        raise UserError(f"{path} is damaged ({err}): {remedy}") from None
