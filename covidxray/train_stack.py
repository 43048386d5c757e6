"""The two installs: the base set classifies (`covidxray predict`: LiteRT, OpenCV, pydicom), the `train`
extra adds what prepare / train / evaluate / export need (pyproject.toml). On an edge install those
commands must say which install they need, not end in an ImportError traceback.
"""

from __future__ import annotations

from covidxray.errors import UserError

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
        "this environment is an edge install, which only classifies (`covidxray predict`). "
        "For training, run `bash scripts/install.sh` in a clone of covidxray (or `pip install 'covidxray[train]'`)"
    )


def require_train_stack() -> None:
    """Fail before long work (e.g. prepare's decoding) whose last step needs TensorFlow."""
    import importlib.util

    if importlib.util.find_spec("tensorflow") is None:
        raise missing_train_stack(ModuleNotFoundError("No module named 'tensorflow'", name="tensorflow"))
