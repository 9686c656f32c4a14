"""Decision policy bands and their comparison rule."""

from __future__ import annotations

import pytest

from mlpair.prediction.policy import DecisionPolicy
from tests.support import CONFIG_DIR


@pytest.fixture(scope="module")
def policy() -> DecisionPolicy:
    return DecisionPolicy.from_toml(CONFIG_DIR / "credit-risk" / "policy.toml")


@pytest.mark.parametrize("p,decision", [(0.0, "APPROVE"), (0.2499, "APPROVE"), (0.25, "REVIEW"),
                                        (0.5499, "REVIEW"), (0.55, "DECLINE"), (1.0, "DECLINE")])
def test_lower_bound_is_inclusive(policy, p, decision):
    assert policy.decide(p).decision == decision


@pytest.mark.parametrize("p", [float("nan"), -0.01, 1.01, float("inf")])
def test_never_decides_on_an_invalid_probability(policy, p):
    with pytest.raises(ValueError):
        policy.decide(p)


def test_bands_must_start_at_zero_and_increase():
    with pytest.raises(ValueError):
        DecisionPolicy.model_validate({"version": "x", "bands": [
            {"decision": "APPROVE", "min_probability": 0.1, "reason_code": "A"}]})
    with pytest.raises(ValueError):
        DecisionPolicy.model_validate({"version": "x", "bands": [
            {"decision": "APPROVE", "min_probability": 0.0, "reason_code": "A"},
            {"decision": "DECLINE", "min_probability": 0.0, "reason_code": "D"}]})
