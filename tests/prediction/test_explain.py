"""Explanation texts and ordering from occluded probabilities (the e2e tests check the numbers)."""

from __future__ import annotations

import numpy as np

from mlpair.prediction.deciding.explain import explain


def test_contributions_are_ordered_and_phrased_in_business_language(credit_schema):
    k = len(credit_schema.features)
    occluded = np.full(k, 0.40)
    names = list(credit_schema.attribute_names)
    occluded[names.index("Records")] = 0.28   # records raised the risk by 12 points
    occluded[names.index("Income")] = 0.47    # income lowered it by 7 points
    occluded[names.index("Age")] = 0.398      # 0.2 points: too small to be a top reason
    result = explain(credit_schema, 0.40, occluded, top_k=3)
    assert [c.feature for c in result.contributions[:3]] == ["Records", "Income", "Age"]
    assert result.top_reasons == ("Prior credit records raised the default risk by 12.0 points",
                                  "Monthly income lowered the default risk by 7.0 points")
    records = result.contributions[0]
    assert records.reason_code == "RECORDS_RAISES_DEFAULT_RISK" and records.contribution == np.float64(0.40) - 0.28
    assert result.contributions[1].reason_code == "INCOME_LOWERS_DEFAULT_RISK"
    unchanged = [c for c in result.contributions if c.contribution == 0]
    assert len(unchanged) == k - 3 and all(c.reason_code.endswith("_KEEPS_DEFAULT_RISK") for c in unchanged)


def test_top_k_limits_the_reasons(churn_schema):
    k = len(churn_schema.features)
    result = explain(churn_schema, 0.9, np.linspace(0.1, 0.5, k), top_k=2)
    assert len(result.top_reasons) == 2 and all("churn risk" in r for r in result.top_reasons)
