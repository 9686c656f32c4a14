"""Logits → calibrated probability of the positive class: the formulas and their fitting.

Shared by training (which fits and evaluates) and PredictionService (which applies, see
``mlpair.prediction.scoring.calibration``), so the probabilities a manifest reports are computed by
the same code that serves. Every map here is finite, in [0, 1] and non-decreasing in the
positive-class margin ``z_pos - max(other z)``, extreme logits included.

Methods:

* Temperature scaling (Guo et al., "On Calibration of Modern Neural Networks", ICML 2017):
  ``p = softmax(z / T)[positive]``; one parameter, never changes the ranking.
* Platt scaling (Platt, "Probabilistic Outputs for Support Vector Machines", 1999):
  ``p = sigmoid(a * margin + b)`` with ``a > 0``, fitted with Platt's smoothed targets.
* Isotonic regression (Zadrozny & Elkan, KDD 2002): a non-decreasing piecewise-linear map
  from margin to probability fitted by pool-adjacent-violators. Flexible enough to over-fit
  small sets, so it is only fitted on at least ``MIN_ISOTONIC_SAMPLES`` samples (Niculescu-Mizil
  & Caruana, ICML 2005, found it worse than Platt below about a thousand).

Label smoothing (Szegedy et al., CVPR 2016): a model trained towards targets
``(1 - eps) * y + eps / K`` has softmax outputs squeezed towards ``1 / K``. With temperature
scaling the inverse map ``(q - eps / K) / (1 - eps)``, clipped to [0, 1], is applied after the
softmax; Platt and isotonic learn the whole margin → probability map and need no correction.
"""

from __future__ import annotations

import numpy as np

MIN_ISOTONIC_SAMPLES = 1000
TEMPERATURE_BOUNDS = (0.05, 20.0)
_EPS_NLL = 1e-12  # probabilities are clipped to [eps, 1 - eps] inside log-likelihoods only


def check_logits(logits: np.ndarray) -> np.ndarray:
    """``[batch, n_classes]`` logits as float64.

    Raises:
        ValueError: not two-dimensional with at least two classes, or NaN / infinity present.
    """
    z = np.asarray(logits, dtype=np.float64)
    if z.ndim != 2 or z.shape[1] < 2:
        raise ValueError(f"logits must be [batch, n_classes >= 2], got shape {list(z.shape)}")
    if not np.isfinite(z).all():
        raise ValueError("logits must be finite")
    return z


def margin(logits: np.ndarray, positive_index: int) -> np.ndarray:
    """Positive-class margin ``z_pos - max(other z)``: ``[batch, n_classes]`` → ``[batch]`` float64.

    Raises:
        ValueError: see :func:`check_logits`.
    """
    z = check_logits(logits)
    others = np.delete(z, positive_index, axis=1)
    return z[:, positive_index] - others.max(axis=1)


def temperature_probability(
    logits: np.ndarray, temperature: float, positive_index: int, label_smoothing: float = 0.0
) -> np.ndarray:
    """Calibrated positive-class probability, ``[batch, n_classes]`` logits → ``[batch]`` in [0, 1].

    Exact softmax for any number of classes, shifted by the row maximum for stability, then
    the label-smoothing inverse when ``label_smoothing`` > 0.

    Raises:
        ValueError: logits contain NaN or infinity, temperature is not positive, or
            label_smoothing is outside [0, 1).
    """
    z = check_logits(logits)
    if not temperature > 0:
        raise ValueError("temperature must be positive")
    z = z / temperature
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    p = e[:, positive_index] / e.sum(axis=1)
    return unsmooth(p, label_smoothing, z.shape[1])


def unsmooth(p: np.ndarray, label_smoothing: float, n_classes: int) -> np.ndarray:
    """Inverse of label smoothing, ``(p - eps / K) / (1 - eps)`` clipped to [0, 1]; identity at eps = 0.

    Raises:
        ValueError: label_smoothing is outside [0, 1).
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError("label_smoothing must be in [0, 1)")
    if label_smoothing == 0.0:
        return p
    return np.clip((p - label_smoothing / n_classes) / (1.0 - label_smoothing), 0.0, 1.0)


def platt_probability(margins: np.ndarray, a: float, b: float) -> np.ndarray:
    """``sigmoid(a * margin + b)``, ``[batch]`` → ``[batch]`` in [0, 1], stable for any finite margin.

    Raises:
        ValueError: ``a`` is not positive (the map would not be increasing).
    """
    if not a > 0:
        raise ValueError("Platt slope a must be positive")
    s = a * np.asarray(margins, dtype=np.float64) + b
    # sigmoid(s) = exp(-logaddexp(0, -s)) never overflows and gives exactly 0 or 1 at the extremes
    return np.exp(-np.logaddexp(0.0, -s))


def isotonic_probability(margins: np.ndarray, knots: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Piecewise-linear interpolation through ``(knots, values)``, constant beyond the ends.

    Args:
        margins: ``[batch]`` positive-class margins.
        knots: ``[k]`` strictly increasing margins. values: ``[k]`` non-decreasing, in [0, 1].
    """
    return np.interp(np.asarray(margins, dtype=np.float64), knots, values)


def _nll(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, _EPS_NLL, 1 - _EPS_NLL)
    return float(-(y * np.log(p) + (1 - y) * np.log1p(-p)).mean())


def fit_temperature(logits: np.ndarray, labels: np.ndarray, positive_index: int, label_smoothing: float = 0.0) -> float:
    """Temperature minimising the negative log-likelihood on held-out ``labels`` (0/1, ``[batch]``).

    The label-smoothing inverse is part of the fitted map. Searched over log T in
    [log 0.05, log 20] with scipy's bounded Brent method.
    """
    from scipy.optimize import minimize_scalar

    y = np.asarray(labels, dtype=np.float64)

    def nll(log_t: float) -> float:
        return _nll(temperature_probability(logits, float(np.exp(log_t)), positive_index, label_smoothing), y)

    low, high = np.log(TEMPERATURE_BOUNDS[0]), np.log(TEMPERATURE_BOUNDS[1])
    return float(np.exp(minimize_scalar(nll, bounds=(low, high), method="bounded").x))


def fit_platt(margins: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """Platt's ``(a, b)`` by maximum likelihood with his smoothed targets
    ``(N+ + 1) / (N+ + 2)`` and ``1 / (N- + 2)`` (which keep the fit finite on separable data).

    Raises:
        ValueError: the labels hold one class, or the best slope is not positive (the scores
            are not informative, so no increasing calibration exists).
    """
    from scipy.optimize import minimize

    m = np.asarray(margins, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    n_pos, n_neg = y.sum(), len(y) - y.sum()
    if n_pos == 0 or n_neg == 0:
        raise ValueError("Platt scaling needs both classes")
    t = np.where(y > 0, (n_pos + 1) / (n_pos + 2), 1 / (n_neg + 2))

    def loss(params: np.ndarray) -> tuple[float, np.ndarray]:
        s = params[0] * m + params[1]
        p = np.exp(-np.logaddexp(0.0, -s))
        # cross-entropy written with logaddexp: -(t log p + (1-t) log(1-p))
        value = float(np.mean(t * np.logaddexp(0.0, -s) + (1 - t) * np.logaddexp(0.0, s)))
        grad = np.array([np.mean((p - t) * m), np.mean(p - t)])
        return value, grad

    result = minimize(loss, np.array([1.0, 0.0]), jac=True, method="L-BFGS-B")
    a, b = (float(v) for v in result.x)
    if not a > 0:
        raise ValueError("Platt scaling found a non-positive slope: the scores carry no signal")
    return a, b


def fit_isotonic(margins: np.ndarray, labels: np.ndarray) -> tuple[list[float], list[float]]:
    """Knots and values of the isotonic (non-decreasing) fit of labels on margins.

    Tied margins are pooled first; pool-adjacent-violators (``scipy.optimize.isotonic_regression``)
    then gives constant blocks, each kept as its first and last margin so interpolation is
    linear between blocks.

    Raises:
        ValueError: fewer than ``MIN_ISOTONIC_SAMPLES`` samples.
    """
    from scipy.optimize import isotonic_regression

    m = np.asarray(margins, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    if len(m) < MIN_ISOTONIC_SAMPLES:
        raise ValueError(f"isotonic calibration needs at least {MIN_ISOTONIC_SAMPLES} samples, got {len(m)}")
    xs, inverse, counts = np.unique(m, return_inverse=True, return_counts=True)
    means = np.bincount(inverse, weights=y) / counts
    fitted = isotonic_regression(means, weights=counts, increasing=True).x
    knots, values = [], []
    for i, (x, v) in enumerate(zip(xs, fitted)):
        first = i == 0 or fitted[i - 1] != v
        last = i == len(xs) - 1 or fitted[i + 1] != v
        if first or last:
            knots.append(float(x))
            values.append(float(np.clip(v, 0.0, 1.0)))
    return knots, values
