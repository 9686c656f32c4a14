"""Realised performance from decisions joined with their outcomes.

"Positive" is the family's positive class, the event its probability estimates (credit-risk: the
applicant defaulted, label ``bad``; churn: the customer left, label ``Yes``). A band of the policy
other than the first **flags** a decision when its calibrated probability reaches the band's
threshold (``p >= min_probability``, or ``>`` under a ``>`` policy): for credit-risk, flagged at
REVIEW's 0.25 means "not approved automatically" and at DECLINE's 0.55 "declined"; for churn, at
RETAIN_OFFER's 0.40 "offered". Then, per band:

* precision = flagged decisions with a positive outcome / flagged decisions (the share of declined
  applicants who did default); None when none was flagged;
* recall = flagged decisions with a positive outcome / positive outcomes (the share of defaulters
  declined); None when no outcome was positive.

The thresholds are applied to the probability, not to the recorded decision, which other rules
(missing data, model disagreement) may have routed to review. The decision rates are the shares of
the recorded decisions (approval rate = share of APPROVE). ROC AUC, ECE (15 equal-width bins) and
Brier are :mod:`mlpair.contracts.metrics`' definitions, the ones training writes as the holdout
figures of each manifest (``metrics.holdout_calibrated``). Decisions without a model probability
(the fallback) are left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mlpair.contracts.metrics import brier_score, expected_calibration_error, roc_auc


@dataclass(frozen=True)
class Threshold:
    """A band's lower bound: the band's decision, its threshold and whether reaching it counts
    (``inclusive``: ``p >= threshold``; else ``p > threshold``)."""

    band: str
    threshold: float
    inclusive: bool = True

    def flags(self, probabilities: np.ndarray) -> np.ndarray:
        """``[n]`` bool: the decisions at or above this band's threshold."""
        return probabilities >= self.threshold if self.inclusive else probabilities > self.threshold


def thresholds_of(policy) -> tuple[Threshold, ...]:
    """The operating thresholds of a :class:`~mlpair.prediction.deciding.policy.DecisionPolicy`:
    every band but the first (which starts at 0)."""
    inclusive = getattr(policy, "comparison", ">=") == ">="
    return tuple(Threshold(b.decision, float(b.min_probability), inclusive) for b in policy.bands[1:])


@dataclass(frozen=True)
class Realised:
    """One family's, version's and window's realised figures (None where undefined: one class only)."""

    family: str
    model_version: str
    window: str
    n: int
    positive_rate: float
    roc_auc: float | None
    ece: float
    brier: float
    precision: dict[str, float | None] = field(default_factory=dict)  # band → precision
    recall: dict[str, float | None] = field(default_factory=dict)  # band → recall
    decision_rates: dict[str, float] = field(default_factory=dict)  # recorded decision → share


def realised(
    family: str,
    model_version: str,
    window: str,
    positive: np.ndarray,
    probability: np.ndarray,
    decision: np.ndarray,
    thresholds: Sequence[Threshold],
    decisions: Sequence[str] = (),
) -> Realised:
    """The realised figures of ``n`` joined decisions.

    Args:
        positive: ``[n]`` 0/1, 1 where the outcome is the positive class.
        probability: ``[n]`` calibrated probabilities in [0, 1].
        decision: ``[n]`` recorded decision labels.
        thresholds: the policy's operating thresholds (:func:`thresholds_of`).
        decisions: decision labels to report a rate for even when absent (rate 0).

    Raises:
        ValueError: ``n`` is 0.
    """
    y = np.asarray(positive, dtype=np.int64)
    p = np.asarray(probability, dtype=np.float64)
    if y.size == 0:
        raise ValueError("no joined decisions")
    both = 0 < y.sum() < y.size
    precision: dict[str, float | None] = {}
    recall: dict[str, float | None] = {}
    for t in thresholds:
        flagged = t.flags(p)
        hits = int((flagged & (y == 1)).sum())
        precision[t.band] = hits / int(flagged.sum()) if flagged.any() else None
        recall[t.band] = hits / int(y.sum()) if y.any() else None
    names, counts = np.unique(np.asarray(decision, dtype=str), return_counts=True)
    rates = dict.fromkeys(decisions, 0.0) | {str(n): int(c) / y.size for n, c in zip(names, counts)}
    return Realised(
        family,
        model_version,
        window,
        int(y.size),
        float(y.mean()),
        roc_auc(y, p) if both else None,
        expected_calibration_error(y, p),
        brier_score(y, p),
        precision,
        recall,
        rates,
    )
