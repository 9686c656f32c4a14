"""Decision policies of both families: bands, the documented comparison, uncertainty routing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlpair.prediction.deciding.policy import DecisionPolicy
from tests.support import CONFIG_DIR


@pytest.fixture(scope="module")
def policy() -> DecisionPolicy:
    return DecisionPolicy.from_toml(CONFIG_DIR / "credit-risk" / "policy.toml")


@pytest.fixture(scope="module")
def churn_policy() -> DecisionPolicy:
    return DecisionPolicy.from_toml(CONFIG_DIR / "churn" / "policy.toml")


def bands(*rows, comparison=">=", uncertainty=None) -> DecisionPolicy:
    data = {"version": "t/v1", "comparison": comparison,
            "bands": [{"decision": d, "min_probability": m, "reason_code": r} for d, m, r in rows]}
    if uncertainty:
        data["uncertainty"] = uncertainty
    return DecisionPolicy.model_validate(data)


@pytest.mark.parametrize("p,decision", [(0.0, "APPROVE"), (0.2499, "APPROVE"), (0.25, "REVIEW"),
                                        (0.5499, "REVIEW"), (0.55, "DECLINE"), (1.0, "DECLINE")])
def test_lower_bound_is_inclusive(policy, p, decision):
    assert policy.comparison == ">="
    assert policy.decide(p).decision == decision


@pytest.mark.parametrize("p,decision", [(0.0, "NO_ACTION"), (0.3999, "NO_ACTION"), (0.40, "RETAIN_OFFER"), (1.0, "RETAIN_OFFER")])
def test_churn_names_its_own_decisions(churn_policy, p, decision):
    verdict = churn_policy.decide(p)
    assert verdict.decision == decision
    assert verdict.reason_codes == ({"NO_ACTION": "LOW_CHURN_RISK", "RETAIN_OFFER": "HIGH_CHURN_RISK"}[decision],)
    assert churn_policy.decisions == ("NO_ACTION", "RETAIN_OFFER", "REVIEW")


@pytest.mark.parametrize("p,decision", [(0.0, "LOW"), (0.5, "LOW"), (0.5000001, "HIGH"), (1.0, "HIGH")])
def test_exclusive_comparison_when_the_file_says_so(p, decision):
    policy = bands(("LOW", 0.0, "L"), ("HIGH", 0.5, "H"), comparison=">")
    assert policy.decide(p).decision == decision


@given(st.floats(0, 1))
def test_every_probability_in_zero_one_gets_exactly_the_band_its_bounds_say(p):
    policy = bands(("A", 0.0, "RA"), ("B", 0.3, "RB"), ("C", 0.7, "RC"))
    expected = "A" if p < 0.3 else "B" if p < 0.7 else "C"
    assert policy.decide(p).decision == expected


@pytest.mark.parametrize("p", [float("nan"), -0.01, 1.01, float("inf")])
def test_never_decides_on_an_invalid_probability(policy, p):
    with pytest.raises(ValueError):
        policy.decide(p)


def test_bands_must_start_at_zero_and_increase():
    with pytest.raises(ValueError):
        bands(("APPROVE", 0.1, "A"))
    with pytest.raises(ValueError):
        bands(("APPROVE", 0.0, "A"), ("DECLINE", 0.0, "D"))


@pytest.mark.parametrize("label", ["approve", "APPROVE ME", "", "X" * 33])
def test_decision_labels_are_stable_identifiers(label):
    with pytest.raises(ValueError):
        bands((label, 0.0, "A"))


def test_spread_above_the_bound_routes_to_the_uncertainty_decision(policy):
    assert policy.uncertainty.max_spread == 0.15
    at_bound = policy.decide(0.1, spread=0.15)
    assert (at_bound.decision, at_bound.reason_codes, at_bound.uncertain) == ("APPROVE", ("LOW_DEFAULT_RISK",), False)
    above = policy.decide(0.1, spread=0.1500001)
    assert (above.decision, above.reason_codes, above.uncertain) == ("REVIEW", ("MODEL_UNCERTAIN", "LOW_DEFAULT_RISK"), True)
    assert above.band.decision == "APPROVE"


def test_without_an_uncertainty_section_spread_is_ignored():
    policy = bands(("A", 0.0, "RA"))
    assert policy.decide(0.2, spread=0.9).decision == "A"
    with pytest.raises(ValueError):
        policy.decide(0.2, spread=float("nan"))


def test_policy_versions_are_named(policy, churn_policy):
    assert policy.version == "credit-risk-policy/v4" and churn_policy.version == "churn-policy/v2"


def test_fallback_decision_is_review_by_default_and_listed_among_decisions():
    policy = DecisionPolicy.model_validate({"version": "x", "bands": [
        {"decision": "NO_ACTION", "min_probability": 0.0, "reason_code": "LOW"},
        {"decision": "RETAIN_OFFER", "min_probability": 0.4, "reason_code": "HIGH"}]})
    assert policy.fallback_decision == "REVIEW"
    assert policy.decisions == ("NO_ACTION", "RETAIN_OFFER", "REVIEW")


def test_insufficient_data_routes_to_review_above_the_bound(policy):
    scarce = policy.insufficient_data
    assert scarce is not None and scarce.decision == "REVIEW"
    low = policy.decide(0.05, 0.0, scarce.max_defaulted_fraction)  # at the bound: the band decides
    assert low.decision == "APPROVE"
    routed = policy.decide(0.05, 0.0, scarce.max_defaulted_fraction + 0.01)
    assert routed.decision == "REVIEW" and routed.reason_codes == ("INSUFFICIENT_DATA", "LOW_DEFAULT_RISK")
    with pytest.raises(ValueError):
        policy.decide(0.05, 0.0, 1.5)
