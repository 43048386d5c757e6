"""Temperature scaling at predict time: the sidecar's T applied to the model's probabilities.

Fitting T happens at export (covidxray/export/calibration.py); this half is numpy only.
"""

from __future__ import annotations

import numpy as np


def apply_temperature(probabilities: np.ndarray, temperature: float, floor: float) -> np.ndarray:
    """softmax(log(max(p, floor)) / T) row-wise; `floor` keeps log finite (int8 outputs hold exact zeros)."""
    logits = np.log(np.maximum(np.asarray(probabilities, dtype=np.float64), floor)) / temperature
    logits -= logits.max(axis=-1, keepdims=True)
    scaled = np.exp(logits)
    return scaled / scaled.sum(axis=-1, keepdims=True)
