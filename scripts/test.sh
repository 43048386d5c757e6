#!/usr/bin/env bash
# Set up (idempotent, see install.sh), lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# ruff is configured in pyproject.toml; a lint finding or an unformatted file fails the run before the long tests
"${VENV:-.venv}/bin/ruff" check .
"${VENV:-.venv}/bin/ruff" format --check .
# mypy is configured in pyproject.toml ([tool.mypy]: covidxray/, zero errors)
"${VENV:-.venv}/bin/mypy"
exec "${VENV:-.venv}/bin/python" -m pytest -q -rs "$@"
