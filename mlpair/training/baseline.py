"""A classical baseline beside the served model: L2-regularised logistic regression.

Fitted on the same training split and the same assembled features (standardised numerics,
one-hot categories) as the network, scored on the same holdout, so the demo can show what the
network adds over a linear model. scikit-learn is not a dependency of this project; the
objective is scikit-learn's default ``LogisticRegression(C=1.0)`` (log-loss summed over rows
plus ``||w||² / 2``, intercept not penalised), minimised with SciPy's L-BFGS-B.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import minimize
from scipy.special import expit


def fit_logistic_regression(x: np.ndarray, y: np.ndarray, l2: float = 1.0) -> np.ndarray:
    """Weights of an L2-regularised logistic regression.

    Args:
        x: ``[n, n_features]`` features (float32 or float64).
        y: ``[n]`` 0/1 labels.
        l2: weight of ``||w||² / 2`` (scikit-learn's ``1 / C``).

    Returns:
        ``[n_features + 1]`` float64: the weights, then the intercept.

    Raises:
        RuntimeError: L-BFGS-B did not converge.
    """
    x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
    result = minimize(
        _objective,
        np.zeros(x64.shape[1] + 1),
        args=(x64, y64, l2),
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": 1000},
    )
    if not result.success:
        raise RuntimeError(f"logistic regression did not converge: {result.message}")
    return result.x


def predict_probability(params: np.ndarray, x: np.ndarray) -> np.ndarray:
    """P(positive) ``[n]`` float64 for ``[n, n_features]`` features and :func:`fit_logistic_regression`'s weights."""
    return expit(np.asarray(x, np.float64) @ params[:-1] + params[-1])


def _objective(params: np.ndarray, x: np.ndarray, y: np.ndarray, l2: float) -> tuple[float, np.ndarray]:
    """Penalised log-loss and its gradient; ``log(1 + e^z)`` as ``logaddexp(0, z)`` (no overflow)."""
    w, b = params[:-1], params[-1]
    z = x @ w + b
    residual = expit(z) - y
    loss = float(np.sum(np.logaddexp(0.0, z) - y * z) + 0.5 * l2 * w @ w)
    return loss, np.append(x.T @ residual + l2 * w, residual.sum())
