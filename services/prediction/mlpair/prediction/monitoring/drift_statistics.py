"""Drift statistics: a window of live values against a training baseline kept as quantiles or
category frequencies (what ``mlpair.training.pipeline.baselines`` writes into the manifest).

- :func:`ks_against_quantiles`: the two-sample Kolmogorov–Smirnov test (Kolmogorov 1933; Smirnov
  1948). The statistic D is the largest gap between the window's empirical CDF and the training
  CDF, read piecewise-linearly between its quantiles (:func:`baseline_cdf`; exact at ties, so
  discrete features such as loan term are not penalised). The p-value is the asymptotic
  two-sample one, ``kstwo.sf(D, round(n·m/(n+m)))`` with m the training rows, as in
  ``scipy.stats.ks_2samp(method="asymp")`` (Hodges 1958, "The significance probability of the
  Smirnov two-sample test", Arkiv för Matematik 3).
- :func:`chi2_against_frequencies`: Pearson's chi-square test of homogeneity (Pearson 1900;
  ``scipy.stats.chi2_contingency`` without Yates' correction) between window counts and training
  counts (frequency × training rows), categories with an expected count below 5 pooled
  (Cochran 1954, "Some methods for strengthening the common χ² tests", Biometrics 10); its effect
  size is the total variation distance ½·Σ|p_i − q_i| between the two frequency vectors (for a
  two-category feature it equals the KS statistic).

Pure functions of NumPy arrays: no state, no metrics (the monitor is :mod:`mlpair.prediction.monitoring.drift`).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

# at import, not on first use: importing scipy.stats holds the GIL for a long while, which would
# stall the serving event loop at the first drift report under load
from scipy.stats import chi2_contingency, kstwo

MIN_EXPECTED_COUNT = 5.0  # Cochran's rule for chi-square cells
# Training rounds baseline quantiles to 6 decimals; window values are rounded the same way so
# an atom (e.g. every applicant with no debt) sits at exactly the same point in both.
BASELINE_DECIMALS = 6


def baseline_cdf(points: np.ndarray, quantiles: np.ndarray, side: Literal["left", "right"] = "right") -> np.ndarray:
    """The training CDF given by ``quantiles`` ``[k]`` (at evenly spaced levels 0 … 1), at ``points``.

    Linear between distinct quantiles; a value repeated in the quantiles is an atom where the CDF
    jumps: ``side="right"`` gives F(p) = P(X ≤ p), ``side="left"`` the limit from the left,
    P(X < p).

    Returns:
        ``[len(points)] float64`` in [0, 1].
    """
    q = np.asarray(quantiles, dtype=np.float64)
    points = np.asarray(points, dtype=np.float64)
    k = len(q)
    levels = np.linspace(0.0, 1.0, k)
    j = np.searchsorted(q, points, side=side)  # q[j-1] ≤ p < q[j] (right) or q[j-1] < p ≤ q[j] (left)
    lo, hi = np.clip(j - 1, 0, k - 1), np.clip(j, 0, k - 1)
    gap = q[hi] - q[lo]
    frac = np.divide(points - q[lo], gap, out=np.zeros_like(points), where=gap > 0)
    cdf = levels[lo] + frac * (levels[hi] - levels[lo])
    return np.where(j == 0, 0.0, np.where(j == k, 1.0, cdf))


def ks_against_quantiles(sample: np.ndarray, quantiles: np.ndarray, reference_rows: int) -> tuple[float, float]:
    """Two-sample KS statistic and p-value of ``sample`` ``[n]`` against a reference given by
    its quantiles ``[k]`` at evenly spaced levels 0 … 1, taken from ``reference_rows`` rows.

    The reference CDF is linear between quantiles and jumps at repeated quantiles (atoms);
    D is evaluated at every sample point and knot, from both sides, so it is exact for that CDF.
    Sample values are rounded to the baseline's 6 decimals first, so shared atoms coincide.
    """
    x = np.sort(np.asarray(sample, dtype=np.float64).round(BASELINE_DECIMALS))
    q = np.asarray(quantiles, dtype=np.float64)
    n = len(x)
    if n == 0:
        return 0.0, 1.0
    points = np.unique(np.concatenate([x, q]))
    sample_right = np.searchsorted(x, points, side="right") / n
    sample_left = np.searchsorted(x, points, side="left") / n
    d = float(
        max(
            np.abs(sample_right - baseline_cdf(points, q, "right")).max(),
            np.abs(sample_left - baseline_cdf(points, q, "left")).max(),
        )
    )
    effective = max(1, round(n * reference_rows / (n + reference_rows)))
    return d, float(kstwo.sf(d, effective))


def chi2_against_frequencies(
    counts: np.ndarray, frequencies: np.ndarray, reference_rows: int
) -> tuple[float, float, float]:
    """Chi-square test of homogeneity of window ``counts`` ``[c]`` against training
    ``frequencies`` ``[c]`` (summing to 1) from ``reference_rows`` rows.

    Returns:
        (chi-square statistic, p-value, total variation distance in [0, 1]).
    """
    observed = np.asarray(counts, dtype=np.float64)
    reference = np.asarray(frequencies, dtype=np.float64) * reference_rows
    n = observed.sum()
    if n == 0:
        return 0.0, 1.0, 0.0
    tv = 0.5 * float(np.abs(observed / n - reference / reference.sum()).sum())
    table = np.vstack([observed, reference])
    table = table[:, table.sum(axis=0) > 0]
    expected_small = table.sum(axis=0) * min(n, reference.sum()) / table.sum() < MIN_EXPECTED_COUNT
    if expected_small.any():
        pooled = table[:, expected_small].sum(axis=1, keepdims=True)
        table = np.hstack([table[:, ~expected_small], pooled])
    if table.shape[1] < 2:
        return 0.0, 1.0, tv
    chi2, p, _, _ = chi2_contingency(table, correction=False)
    return float(chi2), float(p), tv
