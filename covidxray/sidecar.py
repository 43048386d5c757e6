"""The sidecar: the JSON beside each exported .tflite (run_folder.sidecar_path) that says how to use the model.

Contract: `export` (covidxray/export/tflite.py) builds it as JSON and binds it to the model
(covidxray/edge/model_binding.py); `read_sidecar(content)` is the one reader (covidxray/edge/litert.py), returning
a frozen `Sidecar` or raising SidecarError with what is unusable. Every entry predict's answer depends on is
checked here (present, of its type, a positive temperature); litert.py then checks that it fits the model's
shapes, and each gate's fit parses its own entry. Imports only the standard library and covidxray's light
modules: the edge package (no TensorFlow) reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from covidxray.strict import ConfigError, foreign_version, from_dict

SIDECAR_VERSION = 1  # the sidecar's layout: a reader refuses any other
GATE_KEYS = ("ood", "layout", "orientation")  # the input gate's fits (covidxray/edge/predict.py)
# Every entry predict's answer depends on: without `ood` or `layout` a gate check would be silently off.
REQUIRED_KEYS = ("labels", "image_size", "temperature", *GATE_KEYS)


class SidecarError(ValueError):
    """What makes a sidecar unusable, worded to follow "sidecar <path> "."""


@dataclass(frozen=True)
class Sidecar:
    labels: list[str]
    image_size: int
    temperature: dict[str, Any] = field(default_factory=lambda: {"value": 1.0})  # absent only before export's fit
    ood: dict[str, Any] | None = None  # the gate's fits: absent only in export's hands, before it fits them
    layout: dict[str, Any] | None = None
    orientation: dict[str, Any] | None = None
    source_profile: dict[str, Any] | None = None
    task: str | None = None
    model: str | None = None
    preprocessing: Any = None  # a version number; before numbered versions, a description of every step
    harmonise: str = "none"
    dataset_id: str | None = None
    manifest_sha256: str | None = None  # instead of dataset_id, in a sidecar exported from an older model card
    best: dict[str, Any] = field(default_factory=dict)
    format: str | None = None
    keras_model: str | None = None
    keras_sha256: str | None = None
    parity: dict[str, Any] | None = None
    tflite_sha256: str | None = None
    # A sidecar without the field was exported before it existed, in this same layout: version 1.
    version: int = SIDECAR_VERSION

    @property
    def temperature_value(self) -> float:
        return float(self.temperature["value"])


def read_sidecar(content: object, required: tuple[str, ...] = REQUIRED_KEYS) -> Sidecar:
    """The Sidecar in `content` (the sidecar file's JSON); SidecarError naming what makes it unusable."""
    if not isinstance(content, dict):
        raise SidecarError(f"holds a JSON {type(content).__name__}, not an object")
    version = foreign_version(content, "version", SIDECAR_VERSION)
    if version is not None:
        raise SidecarError(
            f"is of version {version!r}, written by another version of covidxray (this one reads version "
            f"{SIDECAR_VERSION}): predict with the covidxray that exported it"
        )
    missing = [key for key in required if key not in content]
    if missing:
        gate = " (without it a check of the input gate would be off)" if set(GATE_KEYS) & set(missing) else ""
        raise SidecarError(f"lacks {', '.join(missing)}{gate}")
    labels = content.get("labels")
    if (
        not isinstance(labels, list)
        or not labels
        or not all(isinstance(x, str) and x for x in labels)
        or len(set(labels)) != len(labels)
    ):
        raise SidecarError(f"labels must be a list of distinct names, got {labels!r}")
    size = content.get("image_size")
    if isinstance(size, bool) or not isinstance(size, int):
        raise SidecarError(f"says image_size {size!r}, not a size in pixels")
    temperature = content.get("temperature", {"value": 1.0})
    value = temperature.get("value") if isinstance(temperature, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SidecarError(f"temperature must be an object with a positive value, got {temperature!r}")
    try:
        return from_dict(Sidecar, content, "sidecar")
    except ConfigError as err:
        raise SidecarError(f"is damaged ({err})") from None
