"""What the report reads: the run folder's files and the prepared data's, each either read or named as missing.

A file that is absent, unreadable or not what it should be (not JSON, not a mapping) is never guessed around:
`json`/`yaml`/`rows`/`binary` (and `artifact`, for a file with a typed reader) return None, and the section that wanted it says "missing" with the reason
`why_missing` gives. Only reads; nothing here writes.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from covidxray.errors import UserError
from covidxray.manifest import MANIFEST
from covidxray.run_folder import CONFIG_FILE

Artifact = TypeVar("Artifact")


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

    def _read(self, name: str, in_data: bool, parse) -> Any:
        path = self.path(name, in_data)
        if path is None:
            self.problems[name] = "no data folder: give --data-dir (the run's config.yaml names none)"
            return None
        if not path.is_file():
            self.problems[name] = f"{path} does not exist"
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

    def artifact(self, name: str, read: Callable[[Path], Artifact]) -> Artifact | None:
        """The run folder's `name` loaded by its own reader (`read(run_dir)`, covidxray/reports.py), or None with
        the reader's words on what is wrong with it."""
        path = self.run_dir / name
        if not path.is_file():
            self.problems[name] = f"{path} does not exist"
            return None
        try:
            return read(self.run_dir)
        except UserError as err:
            self.problems[name] = str(err)
            return None

    def manifest(self) -> dict | None:
        return self.json(MANIFEST, in_data=True)

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
