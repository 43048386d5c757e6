"""The contract modules between stages import nothing heavy: checked in a fresh interpreter each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CONTRACTS = [
    "covidxray.records",
    "covidxray.manifest",
    "covidxray.run_folder",
    "covidxray.files",
    "covidxray.registry",
    "covidxray.strict",
    "covidxray.sidecar",
    "covidxray.reports",
]
EDGE_FORBIDDEN = ["tensorflow", "keras", "tf_keras", "horovod"]
HEAVY = ["tensorflow", "cv2", "sqlite3", "multiprocessing", "horovod", "covidxray.sources"]


def loaded_after_import(*modules: str) -> set[str]:
    """Every module name in sys.modules after importing `modules` in a new interpreter (this test's own imports do not count)."""
    code = f"import importlib, json, sys; [importlib.import_module(m) for m in {list(modules)!r}]; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True)
    return set(json.loads(result.stdout))


@pytest.mark.parametrize("module", CONTRACTS)
def test_contract_module_imports_nothing_heavy(module):
    loaded = loaded_after_import(module)
    assert module in loaded
    assert within(loaded, HEAVY) == []


def within(loaded: set[str], packages: list[str]) -> list[str]:
    return sorted(name for name in loaded if any(name == p or name.startswith(p + ".") for p in packages))


def edge_modules() -> list[str]:
    """Every module file of covidxray/edge, found on disk (not by importing the package)."""
    root = Path(__file__).resolve().parents[1] / "covidxray" / "edge"
    return sorted(f"covidxray.edge.{p.stem}" for p in root.glob("*.py") if p.stem != "__init__") + ["covidxray.edge"]


def test_the_edge_package_never_imports_tensorflow():
    modules = edge_modules()
    assert {
        "covidxray.edge.predict",
        "covidxray.edge.litert",
        "covidxray.edge.preprocess",
        "covidxray.edge.radiograph_gate",
    } <= set(modules)
    loaded = loaded_after_import(*modules)
    assert set(modules) <= loaded
    assert within(loaded, EDGE_FORBIDDEN) == []


def test_sources_do_not_import_the_data_stage():
    loaded = loaded_after_import("covidxray.sources")
    assert "covidxray.sources.synthetic" in loaded  # the registry did load its adapters
    assert sorted(name for name in loaded if name.startswith("covidxray.data")) == []


def test_export_does_not_import_the_training_loop():
    pytest.importorskip("tensorflow")
    loaded = loaded_after_import("covidxray.export.tflite")
    assert "covidxray.train.trainer" not in loaded
