"""Loading a Keras model file without running code from it.

A model file is data that may come from anywhere (a copied run folder, a
sidecar naming another file), and Keras can execute code while loading:
the legacy HDF5 loader unmarshals and runs a Lambda layer's Python bytecode,
and the `.keras` loader imports any module a layer's config names. So before
Keras sees a file, it must be a `.keras` zip (Keras 3 layout: config.json,
metadata.json, weights) whose config names only Keras' own classes, with no
Lambda layer and no TFOpLambda other than plain tensor arithmetic; then it is
loaded with `safe_mode=True`, which also refuses serialised lambdas.
`expected_sha256` pins the exact file (the one a .tflite was converted from).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from covidxray.errors import UserError
from covidxray.files import sha256_file

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_CONFIG = "config.json"
_CONFIG_LIMIT = 64 << 20  # a real model's config is < 1 MB (efficientnet_b0: 0.3 MB); more is not a model
# TFOpLambda calls `tf.<function>` by name on the layer's inputs: these families are tensor arithmetic only
# (MobileNetV3's hard-swish is __operators__.add and math.multiply); anything else (tf.io, tf.py_function...)
# could touch files or run Python.
_TF_OP_FAMILIES = ("__operators__.", "math.", "nn.")


def _refuse(path: Path, why: str) -> UserError:
    return UserError(
        f"{path}: {why}; refusing to load it (a Keras model file can run code). Use a model.keras written by `covidxray train`"
    )


def _unsafe_entries(node, found: list[str]) -> list[str]:
    """Every layer or object in a Keras config that could run code or import outside Keras."""
    if isinstance(node, dict):
        module, name = node.get("module"), node.get("class_name")
        if isinstance(module, str) and not (module == "keras" or module.startswith("keras.")):
            found.append(f"{name} from module {module}")
        if name == "Lambda" or name == "__lambda__":
            found.append("a Lambda layer (Python code)")
        if name == "TFOpLambda":
            function = str((node.get("config") or {}).get("function", ""))
            if not function.startswith(_TF_OP_FAMILIES):
                found.append(f"a TensorFlow call tf.{function}")
        for value in node.values():
            _unsafe_entries(value, found)
    elif isinstance(node, list):
        for value in node:
            _unsafe_entries(value, found)
    return found


def check_keras_file(path: Path) -> None:
    """UserError unless `path` is a `.keras` zip whose config holds only Keras' own layers and plain tensor ops."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(len(HDF5_SIGNATURE))
    except OSError as err:
        raise UserError(f"cannot read {path} ({err.strerror or err})") from None
    if head == HDF5_SIGNATURE:
        raise _refuse(path, "is a legacy HDF5 model, whose loader runs the code of Lambda layers")
    try:
        with zipfile.ZipFile(path) as archive:
            info = archive.getinfo(_CONFIG)
            if info.file_size > _CONFIG_LIMIT:
                raise _refuse(path, f"its {_CONFIG} is {info.file_size:,} bytes")
            config = json.loads(archive.read(info))
    except (zipfile.BadZipFile, KeyError, ValueError, OSError, RuntimeError, EOFError) as err:
        raise _refuse(path, f"is not a .keras model file ({type(err).__name__}: {err})") from None
    unsafe = _unsafe_entries(config, [])
    if unsafe:
        raise _refuse(path, f"its config holds {', '.join(sorted(set(unsafe)))}")


def load_keras_model(path: Path, expected_sha256: str | None = None, expected_what: str = ""):
    """The model at `path`, loaded in safe mode after `check_keras_file`; with `expected_sha256`, only that exact file.

    `expected_what` says where the hash comes from, for the error (e.g. "the model the .tflite was converted from").
    """
    import tensorflow as tf

    path = Path(path)
    if not path.is_file():
        raise UserError(f"Keras model {path} not found")
    if expected_sha256 is not None and sha256_file(path) != expected_sha256:
        raise UserError(f"{path} is not {expected_what} (sha256 differs)")
    check_keras_file(path)
    try:
        return tf.keras.models.load_model(str(path), compile=False, safe_mode=True)
    except (ValueError, TypeError, KeyError, OSError) as err:
        raise _refuse(
            path, f"Keras cannot load it in safe mode ({type(err).__name__}: {' '.join(str(err).split())[:300]})"
        ) from None
