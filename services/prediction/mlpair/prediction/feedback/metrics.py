"""Prometheus metrics of outcome feedback (``prediction_outcomes_*``, ``prediction_realised_*``,
``prediction_holdout_*``).

Labels are bounded: ``family`` is a served family, ``model_version`` one that decided,
``window`` one of ``PREDICTION_OUTCOME_WINDOWS_H``, ``band`` one of the policy's bands,
``decision`` one of the policy's decisions, ``result`` one of five outcomes of an item.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

OUTCOMES = Counter(
    "prediction_outcomes_total",
    "Outcome items received, by result: stored (its decision on record), unmatched (stored for a later "
    "join: no decision on record yet), duplicate (on record already), conflict (another label on record), "
    "refused (invalid).",
    ["result"],
)
OUTCOMES_UNJOINED = Gauge(
    "prediction_outcomes_unjoined", "Outcomes on record that no recorded decision joins yet (at the last refresh)."
)
_KEY = ["family", "model_version", "window"]
REALISED_OUTCOMES = Gauge(
    "prediction_realised_outcomes", "Decisions with a model probability joined with their outcome.", _KEY
)
REALISED_POSITIVE_RATE = Gauge(
    "prediction_realised_positive_rate", "Share of joined decisions whose outcome is the positive class.", _KEY
)
REALISED_ROC_AUC = Gauge("prediction_realised_roc_auc", "ROC AUC of the calibrated probability on outcomes.", _KEY)
REALISED_ECE = Gauge("prediction_realised_ece", "Expected calibration error (15 equal-width bins) on outcomes.", _KEY)
REALISED_BRIER = Gauge("prediction_realised_brier", "Brier score of the calibrated probability on outcomes.", _KEY)
REALISED_PRECISION = Gauge(
    "prediction_realised_precision",
    "Of the decisions at or above a band's threshold, the share whose outcome is positive.",
    [*_KEY, "band"],
)
REALISED_RECALL = Gauge(
    "prediction_realised_recall",
    "Of the positive outcomes, the share whose decision was at or above a band's threshold.",
    [*_KEY, "band"],
)
REALISED_DECISION_RATE = Gauge(
    "prediction_realised_decision_rate", "Share of joined decisions per recorded decision.", [*_KEY, "decision"]
)
HOLDOUT_ROC_AUC = Gauge(
    "prediction_holdout_roc_auc", "The served version's holdout ROC AUC (its manifest).", ["family", "model_version"]
)
HOLDOUT_ECE = Gauge(
    "prediction_holdout_ece", "The served version's holdout ECE, 15 bins (its manifest).", ["family", "model_version"]
)
