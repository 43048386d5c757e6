"""Arrays and counts in the sidecar JSON: arrays as little-endian float32 in base64, read back as float64 for the
arithmetic; every number validated before predict builds on it."""

from __future__ import annotations

import base64

import numpy as np


def pack(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype="<f4").tobytes()).decode("ascii")


def unpack(text: str, shape: tuple[int, ...]) -> np.ndarray:
    """ValueError when the text is not base64 of that many finite float32 values."""
    array = np.frombuffer(base64.b64decode(text, validate=True), dtype="<f4").astype(np.float64).reshape(shape)
    if not np.isfinite(array).all():
        raise ValueError("holds values that are not finite numbers")
    return array


def threshold(value) -> float:
    """A gate threshold from the sidecar: a finite positive number, else ValueError (NaN would compare false and let
    every image pass; infinity or zero would turn the check off or refuse everything)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value <= 0:
        raise ValueError(f"threshold {value!r} is not a finite positive number")
    return float(value)


def count(value) -> int:
    """A count from the sidecar (of perceptrons, of their units): an integer from 1 to 1024, else ValueError (the
    arrays' shapes are built from it before their lengths are checked)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 1024:
        raise ValueError(f"{value!r} is not a count from 1 to 1024")
    return value
