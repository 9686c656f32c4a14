"""Logits → calibrated probability of the positive class.

Temperature scaling (Guo et al., "On Calibration of Modern Neural Networks", ICML 2017):
``p = softmax(z / T)[positive]``. For two classes this is ``sigmoid((z_pos - z_neg) / T)``,
computed here in a numerically stable form so extreme logits give 0 or 1, never NaN.
"""

from __future__ import annotations

import numpy as np


def margin(logits: np.ndarray, positive_index: int) -> np.ndarray:
    """Positive-class margin ``z_pos - max(other z)``: ``[batch, n_classes]`` → ``[batch]`` float64."""
    z = np.asarray(logits, dtype=np.float64)
    others = np.delete(z, positive_index, axis=1)
    return z[:, positive_index] - others.max(axis=1)


def temperature_probability(logits: np.ndarray, temperature: float, positive_index: int) -> np.ndarray:
    """Calibrated positive-class probability, ``[batch, n_classes]`` logits → ``[batch]`` in [0, 1].

    Exact softmax for any number of classes, shifted by the row maximum for stability.

    Raises:
        ValueError: logits contain NaN or infinity, or temperature is not positive.
    """
    z = np.asarray(logits, dtype=np.float64)
    if not np.isfinite(z).all():
        raise ValueError("logits must be finite")
    if not temperature > 0:
        raise ValueError("temperature must be positive")
    z = z / temperature
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e[:, positive_index] / e.sum(axis=1)


def fit_temperature(logits: np.ndarray, labels: np.ndarray, positive_index: int) -> float:
    """Temperature minimising the negative log-likelihood on held-out ``labels`` (0/1, ``[batch]``).

    Searched over log T in [log 0.05, log 20] with scipy's bounded Brent method.
    """
    from scipy.optimize import minimize_scalar

    y = np.asarray(labels, dtype=np.float64)

    def nll(log_t: float) -> float:
        p = np.clip(temperature_probability(logits, float(np.exp(log_t)), positive_index), 1e-12, 1 - 1e-12)
        return float(-(y * np.log(p) + (1 - y) * np.log1p(-p)).mean())

    result = minimize_scalar(nll, bounds=(np.log(0.05), np.log(20.0)), method="bounded")
    return float(np.exp(result.x))
