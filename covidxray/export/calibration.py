"""Temperature scaling (Guo et al., 2017): one scalar T > 0 that makes probabilities honest.

The exported models end in a softmax, so the logits are the log-probabilities
up to a per-image constant, which the softmax ignores: softmax(log(p) / T) is
exactly temperature scaling of the logits. T is fitted at export on the
validation split, by minimising its negative log-likelihood over log T (a
bounded 1-D search), and stored in the sidecar; predict applies it. T > 1
softens an overconfident model, T < 1 sharpens an underconfident one; the
top-1 class never changes.

Applying T is covidxray/edge/calibration.py (numpy only, predict on a Pi); fitting also uses scipy, a
dependency of scikit-learn on the training machine.
"""

from __future__ import annotations

import numpy as np

from covidxray.edge.calibration import apply_temperature
from covidxray.train.metrics import expected_calibration_error

# The search range for T: wide enough for any real model (a model that needs T beyond it is broken).
LOG_T_BOUNDS = (np.log(0.05), np.log(20.0))


def negative_log_likelihood(probabilities: np.ndarray, labels: np.ndarray) -> float:
    picked = np.asarray(probabilities)[np.arange(len(labels)), np.asarray(labels)]
    return float(-np.mean(np.log(np.maximum(picked, 1e-12))))


def fit_temperature(probabilities: np.ndarray, labels: np.ndarray, floor: float) -> float:
    """The T minimising the NLL of `labels` under apply_temperature(probabilities, T)."""
    from scipy.optimize import minimize_scalar

    def loss(log_t: float) -> float:
        return negative_log_likelihood(apply_temperature(probabilities, float(np.exp(log_t)), floor), labels)

    found = minimize_scalar(loss, bounds=LOG_T_BOUNDS, method="bounded", options={"xatol": 1e-4})
    return float(np.exp(found.x))


def calibration_summary(probabilities: np.ndarray, labels: np.ndarray, floor: float) -> dict:
    """Fit T and say what it changed on the data it was fitted on (for the sidecar and the export report)."""
    temperature = fit_temperature(probabilities, labels, floor)
    scaled = apply_temperature(probabilities, temperature, floor)
    return {
        "value": temperature,
        # At a bound the NLL still fell towards it: e.g. a val split the model separates perfectly, where
        # sharpening never stops paying. The value is then the search limit, not an estimate.
        "at_search_bound": bool(np.min(np.abs(np.log(temperature) - np.array(LOG_T_BOUNDS))) < 1e-3),
        "fitted_on": "val",
        "images": int(len(labels)),
        "nll_before": negative_log_likelihood(np.maximum(probabilities, floor), labels),
        "nll_after": negative_log_likelihood(scaled, labels),
        "ece_before": expected_calibration_error(labels, probabilities),
        "ece_after": expected_calibration_error(labels, scaled),
    }
