"""Arrays in the sidecar JSON: little-endian float32, base64, read back as float64 for the arithmetic."""

from __future__ import annotations

import base64

import numpy as np


def pack(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype="<f4").tobytes()).decode("ascii")


def unpack(text: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<f4").astype(np.float64).reshape(shape)
