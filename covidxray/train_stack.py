"""The two installs: the base set classifies (`covidxray predict`: LiteRT, OpenCV, pydicom), the `train`
extra adds what prepare / train / evaluate / export need (pyproject.toml). On an edge install those
commands must say which install they need, not end in an ImportError traceback.
"""

from __future__ import annotations

import sys

from covidxray.errors import UserError

# TensorFlow 2.15 (Keras 2, which Horovod 0.28.1 needs) publishes wheels for CPython 3.9 to 3.11 only.
TRAINING_PYTHON = (3, 11)

# Top-level modules that only the training install provides -> what to call them in the message.
TRAIN_STACK_MODULES = {
    "tensorflow": "TensorFlow",
    "keras": "Keras (TensorFlow)",
    "tf_keras": "Keras (TensorFlow)",
    "sklearn": "scikit-learn",
    "albumentations": "albumentations",
    "kaggle": "the kaggle client",
    "matplotlib": "matplotlib",
    "horovod": "Horovod",
}


def missing_train_stack(err: ModuleNotFoundError) -> UserError | None:
    """The error to show when `err` is a training-only module missing from an edge install, else None."""
    top = (err.name or "").split(".")[0]
    if top not in TRAIN_STACK_MODULES:
        return None
    return UserError(
        f"this command needs {TRAIN_STACK_MODULES[top]} (module '{top}'), which is part of the training install; "
        f"this environment is an edge install, which only classifies (`covidxray predict`). {how_to_train()}"
    )


def how_to_train() -> str:
    """Where the training install comes from, said for this interpreter: on another Python than 3.11 it cannot be
    installed beside the edge install at all."""
    python = sys.version_info[:2]
    if python == TRAINING_PYTHON:
        return (
            "For training, run `bash scripts/install.sh` in a clone of covidxray (or `pip install 'covidxray[train]'`)"
        )
    wanted, this = ".".join(map(str, TRAINING_PYTHON)), ".".join(map(str, python))
    return (
        f"The training install needs Python {wanted} (TensorFlow 2.15 and Horovod 0.28.1 have no build for "
        f"Python {this}): install a Python {wanted} beside this one "
        f"(e.g. `uv python install {wanted}`) and run `PYTHON=/path/to/python{wanted} bash scripts/install.sh` "
        f"in a clone of covidxray (or `pip install 'covidxray[train]'` with that Python); docs/cluster.md, section 1.2"
    )


def require_train_stack() -> None:
    """Fail before long work (e.g. prepare's decoding) whose last step needs TensorFlow.

    Raises what the import itself would raise, so the CLI reports it as it reports a missing import
    (missing_train_stack, whose message names `covidxray[train]`: printed as text, not as rich markup)."""
    import importlib.util

    if importlib.util.find_spec("tensorflow") is None:
        raise ModuleNotFoundError("No module named 'tensorflow'", name="tensorflow")
