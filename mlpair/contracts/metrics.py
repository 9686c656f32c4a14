"""Evaluation metrics for binary probabilities (numpy + scipy only)."""

from __future__ import annotations

import numpy as np


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC via the Mann–Whitney U statistic with average ranks for ties.

    Raises:
        ValueError: ``labels`` holds only one class.
    """
    from scipy.stats import rankdata

    y = np.asarray(labels).astype(bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("ROC AUC needs both classes")
    ranks = rankdata(np.asarray(scores, dtype=np.float64))
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def brier_score(labels: np.ndarray, probabilities: np.ndarray) -> float:
    """Mean squared error between probabilities and 0/1 outcomes (Brier 1950)."""
    y = np.asarray(labels, dtype=np.float64)
    return float(np.mean((np.asarray(probabilities, dtype=np.float64) - y) ** 2))


def expected_calibration_error(labels: np.ndarray, probabilities: np.ndarray, n_bins: int = 15) -> float:
    """ECE with equal-width bins (Naeini et al. 2015; 15 bins as in Guo et al. 2017).

    Computed on the positive-class probability: sum over bins of
    ``|bin| / n * |mean(label) - mean(probability)|``.
    """
    y = np.asarray(labels, dtype=np.float64)
    p = np.asarray(probabilities, dtype=np.float64)
    bins = np.minimum((p * n_bins).astype(int), n_bins - 1)
    ece = 0.0
    for b in range(n_bins):
        mask = bins == b
        if mask.any():
            ece += mask.mean() * abs(y[mask].mean() - p[mask].mean())
    return float(ece)


def summary(labels: np.ndarray, probabilities: np.ndarray) -> dict[str, float]:
    """ROC AUC, Brier score, ECE (15 bins) and count, as a dict for manifests and reports."""
    return {
        "roc_auc": roc_auc(labels, probabilities),
        "brier": brier_score(labels, probabilities),
        "ece_15": expected_calibration_error(labels, probabilities),
        "n": float(len(labels)),
    }
