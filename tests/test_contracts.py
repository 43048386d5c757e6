"""The contract modules between stages import nothing heavy: checked in a fresh interpreter each."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CONTRACTS = ["covidxray.records", "covidxray.manifest", "covidxray.run_folder", "covidxray.files"]
HEAVY = ["tensorflow", "cv2", "sqlite3", "multiprocessing", "horovod", "covidxray.sources"]


def loaded_after_import(module: str) -> set[str]:
    """Every module name in sys.modules after `import module` in a new interpreter (this test's own imports do not count)."""
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True)
    return set(json.loads(result.stdout))


@pytest.mark.parametrize("module", CONTRACTS)
def test_contract_module_imports_nothing_heavy(module):
    loaded = loaded_after_import(module)
    assert module in loaded
    heavy = sorted(name for name in loaded if any(name == h or name.startswith(h + ".") for h in HEAVY))
    assert heavy == []


def test_export_does_not_import_the_training_loop():
    pytest.importorskip("tensorflow")
    loaded = loaded_after_import("covidxray.export.tflite")
    assert "covidxray.train.trainer" not in loaded
