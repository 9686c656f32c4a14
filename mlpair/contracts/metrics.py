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


def reliability_curve(labels: np.ndarray, probabilities: np.ndarray, n_bins: int = 15) -> dict[str, np.ndarray]:
    """Per equal-width bin (the ECE's bins): mean probability, observed frequency and count.

    Returns:
        ``{"mean_probability", "frequency", "count"}``, each ``[n_bins]``; empty bins hold NaN and 0.
    """
    y = np.asarray(labels, dtype=np.float64)
    p = np.asarray(probabilities, dtype=np.float64)
    bins = np.minimum((p * n_bins).astype(int), n_bins - 1)
    count = np.bincount(bins, minlength=n_bins).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_p = np.bincount(bins, weights=p, minlength=n_bins) / count
        freq = np.bincount(bins, weights=y, minlength=n_bins) / count
    return {"mean_probability": mean_p, "frequency": freq, "count": count}


def roc_curve(labels: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """False and true positive rates at every distinct score threshold, from (0, 0) to (1, 1).

    Raises:
        ValueError: ``labels`` holds only one class.
    """
    y = np.asarray(labels).astype(bool)
    s = np.asarray(scores, dtype=np.float64)
    if y.all() or not y.any():
        raise ValueError("a ROC curve needs both classes")
    order = np.argsort(-s, kind="mergesort")
    s, y = s[order], y[order]
    last_of_tie = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]
    tp = np.cumsum(y)[last_of_tie]
    fp = np.cumsum(~y)[last_of_tie]
    return np.r_[0.0, fp / fp[-1]], np.r_[0.0, tp / tp[-1]]
