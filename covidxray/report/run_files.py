"""What the report reads: the run folder's files and the prepared data's, each either read or named as missing.

A file that is absent, unreadable or not what it should be (not JSON, not a mapping) is never guessed around:
`json`/`yaml`/`rows`/`binary` return None, and the section that wanted it says "missing" with the reason
`why_missing` gives. A file that crosses a stage (the manifest, the model card, a sidecar, the two reports) is read
only by its own typed loader, through `artifact`: damaged, edited or of another version, it is missing with the
loader's words. Only reads; nothing here writes.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from covidxray.errors import UserError
from covidxray.manifest import MANIFEST, PreparedData, open_prepared
from covidxray.run_folder import CONFIG_FILE, MODEL_CARD, ModelCard, read_model_card
from covidxray.sidecar import Sidecar, SidecarError, read_sidecar

Artifact = TypeVar("Artifact")
NO_DATA_DIR = "no data folder: give --data-dir (the run's config.yaml names none)"


class RunFiles:
    """`run_dir` and its data folder (`data_dir`, default: the one the run's config.yaml names)."""

    def __init__(self, run_dir: Path, data_dir: Path | None = None):
        self.run_dir = Path(run_dir)
        self.problems: dict[str, str] = {}
        config = self.yaml(CONFIG_FILE)
        configured = (config or {}).get("data", {}).get("data_dir") if isinstance(config, dict) else None
        self.data_dir = Path(data_dir) if data_dir else Path(configured) if configured else None
        self.data_dir_origin = "--data-dir" if data_dir else f"{CONFIG_FILE} data.data_dir" if configured else ""

    def path(self, name: str, in_data: bool = False) -> Path | None:
        if in_data:
            return self.data_dir / name if self.data_dir else None
        return self.run_dir / name

    def _existing(self, name: str, in_data: bool) -> Path | None:
        """The file's path, or None with why it is missing."""
        path = self.path(name, in_data)
        if path is None:
            self.problems[name] = NO_DATA_DIR
            return None
        if not path.is_file():
            self.problems[name] = f"{path} does not exist"
            return None
        return path

    def _read(self, name: str, in_data: bool, parse) -> Any:
        path = self._existing(name, in_data)
        if path is None:
            return None
        try:
            return parse(path)
        except (OSError, ValueError, yaml.YAMLError, UnicodeDecodeError, csv.Error) as err:
            self.problems[name] = f"{path} could not be read ({type(err).__name__}: {err})"
            return None

    def json(self, name: str, in_data: bool = False) -> dict | None:
        value = self._read(name, in_data, lambda p: json.loads(p.read_bytes()))
        if value is not None and not isinstance(value, dict):
            self.problems[name] = f"{self.path(name, in_data)} is not a JSON object"
            return None
        return value

    def artifact(self, name: str, read: Callable[[Path], Artifact], in_data: bool = False) -> Artifact | None:
        """`name` of the run folder (of the data folder: `in_data`) loaded by its own reader (`read(folder)`), or
        None with the reader's words on what is wrong with it."""
        path = self._existing(name, in_data)
        if path is None:
            return None
        try:
            return read(path.parent)
        except UserError as err:
            self.problems[name] = str(err)
            return None

    def prepared(self) -> PreparedData | None:
        """The data folder's prepared data set (its manifest), as `open_prepared` reads it."""
        return self.artifact(MANIFEST, open_prepared, in_data=True)

    def model_card(self) -> ModelCard | None:
        return self.artifact(MODEL_CARD, read_model_card)

    def sidecar(self, name: str) -> Sidecar | None:
        """The run folder's sidecar `name` (run_folder.sidecar_path), as predict reads it (covidxray/sidecar.py)."""
        return self.artifact(name, lambda folder: _sidecar_file(folder / name))

    def yaml(self, name: str) -> dict | None:
        value = self._read(name, False, lambda p: yaml.safe_load(p.read_text()))
        return value if isinstance(value, dict) else None

    def rows(self, name: str) -> list[dict] | None:
        """A CSV table of the data folder as dicts (header row = keys)."""

        def parse(path: Path) -> list[dict]:
            with open(path, newline="") as handle:
                return list(csv.DictReader(handle))

        return self._read(name, True, parse)

    def binary(self, name: str) -> bytes | None:
        return self._read(name, False, lambda p: p.read_bytes())

    def why_missing(self, name: str) -> str:
        return self.problems.get(name, f"{name} was not read")


def _sidecar_file(path: Path) -> Sidecar:
    """The sidecar at `path` read by `read_sidecar`; UserError worded as predict words it (covidxray/edge/litert.py)."""
    try:
        content = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as err:
        raise UserError(f"sidecar {path} is damaged ({type(err).__name__}: {err}): export again") from None
    try:
        return read_sidecar(content)
    except SidecarError as err:
        raise UserError(f"sidecar {path} {err}: export again") from None
