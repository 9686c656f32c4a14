"""Calibration maps (temperature, Platt, isotonic, label smoothing) and evaluation metrics.

Property tests (hypothesis): for any finite float32 logits every map gives probabilities that
are finite, in [0, 1] and non-decreasing in the positive-class logit, extreme logits included.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from mlpair.contracts import calibration as cal
from mlpair.contracts.manifest import Calibration, IsotonicParams, PlattParams
from mlpair.contracts.metrics import brier_score, expected_calibration_error, reliability_curve, roc_auc, roc_curve

F32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
EXTREMES = np.array([-3.4e38, -1e30, -1e4, -50.0, -1.0, 0.0, 1.0, 50.0, 1e4, 1e30, 3.4e38], dtype=np.float32)


def rng_data(n: int, true_temperature: float = 2.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    margin = rng.normal(0, 3, n)
    labels = (rng.random(n) < 1 / (1 + np.exp(-margin / true_temperature))).astype(int)
    return margin, labels


def two_class(positive: np.ndarray, negative: float | np.ndarray = 0.0) -> np.ndarray:
    """Logits ``[batch, 2] float32`` with the positive class at index 1."""
    positive = np.asarray(positive, dtype=np.float32)
    return np.stack([np.broadcast_to(np.float32(negative), positive.shape), positive], axis=1).astype(np.float32)


@pytest.fixture(scope="module")
def fitted() -> Calibration:
    margin, labels = rng_data(3000)
    knots, values = cal.fit_isotonic(margin, labels)
    a, b = cal.fit_platt(margin, labels)
    return Calibration(temperature=cal.fit_temperature(two_class(margin), labels, 1), platt=PlattParams(a=a, b=b),
                       isotonic=IsotonicParams(knots=knots, values=values), n_samples=3000)


METHODS = ["none", "temperature", "platt", "isotonic"]


def assert_valid_and_monotone(p: np.ndarray) -> None:
    assert np.isfinite(p).all() and (p >= 0).all() and (p <= 1).all()
    assert (np.diff(p) >= 0).all()


@pytest.mark.parametrize("method", METHODS)
@settings(max_examples=150, deadline=None)
@given(positive=arrays(np.float32, st.integers(1, 40), elements=F32), negative=F32)
def test_probabilities_are_finite_bounded_and_monotone_in_the_logit(fitted, method, positive, negative):
    p = fitted.probabilities(two_class(np.sort(positive), negative), 1, method)
    assert_valid_and_monotone(p)


@pytest.mark.parametrize("method", METHODS)
def test_extreme_logits(fitted, method):
    p = fitted.probabilities(two_class(EXTREMES), 1, method)
    assert_valid_and_monotone(p)
    if method in ("none", "temperature", "platt"):
        assert p[0] == 0.0 and p[-1] == 1.0


@settings(max_examples=100, deadline=None)
@given(temperature=st.floats(0.05, 20), epsilon=st.floats(0, 0.5), positive=arrays(np.float32, 10, elements=F32))
def test_temperature_with_label_smoothing_stays_monotone_and_bounded(temperature, epsilon, positive):
    p = cal.temperature_probability(two_class(np.sort(positive)), temperature, 1, epsilon)
    assert_valid_and_monotone(p)


def test_temperature_of_zero_margin_is_one_half():
    assert cal.temperature_probability(two_class(np.zeros(1)), 1.7, 1)[0] == 0.5


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_logits_are_refused(fitted, bad):
    for method in METHODS:
        with pytest.raises(ValueError):
            fitted.probabilities(np.array([[0.0, bad]]), 1, method)


def test_fit_temperature_recovers_a_known_temperature():
    margin, labels = rng_data(20000)
    assert cal.fit_temperature(two_class(margin), labels, 1) == pytest.approx(2.0, rel=0.05)


def test_fit_platt_recovers_a_known_map():
    margin, labels = rng_data(20000, true_temperature=2.0)
    a, b = cal.fit_platt(margin, labels)
    assert a == pytest.approx(0.5, rel=0.05) and abs(b) < 0.05


def test_platt_refuses_uninformative_scores():
    rng = np.random.default_rng(3)
    margin = rng.normal(size=2000)
    with pytest.raises(ValueError, match="slope"):
        cal.fit_platt(margin, (margin < 0).astype(int))  # anti-correlated: no increasing map exists


def test_isotonic_needs_at_least_a_thousand_samples():
    margin, labels = rng_data(999)
    with pytest.raises(ValueError, match="1000"):
        cal.fit_isotonic(margin, labels)
    knots, values = cal.fit_isotonic(*rng_data(1000))
    with pytest.raises(ValueError, match="1000"):  # the manifest refuses serving it from fewer
        Calibration(method="isotonic", temperature=1.0, isotonic=IsotonicParams(knots=knots, values=values), n_samples=999)


def test_isotonic_fit_is_calibrated_on_fresh_data(fitted):
    margin, labels = rng_data(20000, seed=7)
    p = fitted.probabilities(two_class(margin), 1, "isotonic")
    assert expected_calibration_error(labels, p) < 0.02


def test_isotonic_params_must_be_monotone():
    with pytest.raises(ValueError):
        IsotonicParams(knots=[0.0, 1.0], values=[0.6, 0.4])
    with pytest.raises(ValueError):
        IsotonicParams(knots=[1.0, 0.0], values=[0.4, 0.6])


def test_label_smoothing_inverse_recovers_the_unsmoothed_probability():
    epsilon = 0.1
    p = np.linspace(0.0, 1.0, 101)
    q = (1 - epsilon) * p + epsilon / 2  # what a model trained with label smoothing would output
    logits = two_class(np.log(q) - np.log1p(-q))
    np.testing.assert_allclose(cal.temperature_probability(logits, 1.0, 1, epsilon), p, atol=1e-6)


def test_fit_temperature_accounts_for_label_smoothing():
    epsilon = 0.1
    margin, labels = rng_data(20000, true_temperature=1.0)
    p = 1 / (1 + np.exp(-margin))
    q = (1 - epsilon) * p + epsilon / 2
    logits = two_class(np.log(q) - np.log1p(-q))
    assert cal.fit_temperature(logits, labels, 1, epsilon) == pytest.approx(1.0, rel=0.05)


def test_manifest_calibration_refuses_a_method_it_did_not_fit():
    with pytest.raises(ValueError):
        Calibration(method="platt", temperature=1.0)
    with pytest.raises(ValueError):
        Calibration(temperature=1.0).probabilities(two_class(np.zeros(2)), 1, "isotonic")


def test_metrics_on_known_values():
    y = np.array([0, 0, 1, 1])
    assert roc_auc(y, np.array([0.1, 0.4, 0.35, 0.8])) == 0.75
    assert brier_score(y, np.array([0.0, 0.0, 1.0, 1.0])) == 0.0
    assert expected_calibration_error(y, np.array([0.5, 0.5, 0.5, 0.5])) == 0.0
    assert expected_calibration_error(np.array([1, 1]), np.array([0.2, 0.2])) == pytest.approx(0.8)


def test_roc_curve_area_equals_roc_auc():
    rng = np.random.default_rng(5)
    y = rng.random(500) < 0.3
    s = np.round(rng.random(500) + y * 0.5, 2)  # rounding makes ties
    fpr, tpr = roc_curve(y, s)
    assert fpr[0] == tpr[0] == 0 and fpr[-1] == tpr[-1] == 1
    assert np.trapezoid(tpr, fpr) == pytest.approx(roc_auc(y, s), abs=1e-12)


def test_reliability_curve_bins_match_the_ece():
    rng = np.random.default_rng(6)
    p = rng.random(1000)
    y = (rng.random(1000) < p).astype(int)
    curve = reliability_curve(y, p)
    filled = curve["count"] > 0
    ece = np.sum(curve["count"][filled] / 1000 * np.abs(curve["frequency"][filled] - curve["mean_probability"][filled]))
    assert ece == pytest.approx(expected_calibration_error(y, p))
