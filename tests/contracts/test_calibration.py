"""Temperature calibration and evaluation metrics."""

from __future__ import annotations

import numpy as np
import pytest

from mlpair.contracts.calibration import fit_temperature, temperature_probability
from mlpair.contracts.metrics import brier_score, expected_calibration_error, roc_auc


def test_probabilities_are_finite_bounded_and_monotone_for_extreme_logits():
    margins = np.array([-1e30, -1e4, -50.0, -1.0, 0.0, 1.0, 50.0, 1e4, 1e30])
    logits = np.stack([np.zeros_like(margins), margins], axis=1)
    p = temperature_probability(logits, 1.7, positive_index=1)
    assert np.isfinite(p).all() and (p >= 0).all() and (p <= 1).all()
    assert (np.diff(p) >= 0).all()
    assert p[0] == 0.0 and p[-1] == 1.0 and p[4] == 0.5


def test_non_finite_logits_are_refused():
    with pytest.raises(ValueError):
        temperature_probability(np.array([[0.0, np.nan]]), 1.0, 1)


def test_fit_temperature_recovers_a_known_temperature():
    rng = np.random.default_rng(0)
    margin = rng.normal(0, 3, 20000)
    labels = rng.random(20000) < 1 / (1 + np.exp(-margin / 2.0))  # true temperature 2
    logits = np.stack([np.zeros_like(margin), margin], axis=1)
    assert fit_temperature(logits, labels, 1) == pytest.approx(2.0, rel=0.05)


def test_metrics_on_known_values():
    y = np.array([0, 0, 1, 1])
    assert roc_auc(y, np.array([0.1, 0.4, 0.35, 0.8])) == 0.75
    assert brier_score(y, np.array([0.0, 0.0, 1.0, 1.0])) == 0.0
    assert expected_calibration_error(y, np.array([0.5, 0.5, 0.5, 0.5])) == 0.0
    assert expected_calibration_error(np.array([1, 1]), np.array([0.2, 0.2])) == pytest.approx(0.8)
