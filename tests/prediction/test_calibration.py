"""Serving-side calibration: the manifest's method, and no decision on a non-finite logit."""

from __future__ import annotations

import numpy as np
import pytest

from mlpair.prediction.errors import InferenceFailed
from mlpair.prediction.scoring.calibration import Calibrator


def test_the_served_method_and_parameters_come_from_the_manifest(credit_entry, churn_entry):
    for entry in (credit_entry, churn_entry):
        calibrator = Calibrator(entry.manifest)
        assert calibrator.method == entry.manifest.calibration.method == "temperature"
        logits = np.array([[0.0, 1.0], [0.3, -2.0]], np.float32)
        np.testing.assert_array_equal(calibrator.probabilities(logits),
                                      entry.manifest.calibration.probabilities(logits, entry.manifest.positive_index))


@pytest.mark.parametrize("method", ["platt", "isotonic"])
def test_other_fitted_methods_can_be_served(churn_entry, method):
    manifest = churn_entry.manifest.model_copy(update={
        "calibration": churn_entry.manifest.calibration.model_copy(update={"method": method})})
    p = Calibrator(manifest).probabilities(np.array([[0.0, -3e38], [0.0, -1.0], [0.0, 0.0], [0.0, 2.0], [0.0, 3e38]],
                                                    np.float32))
    assert np.isfinite(p).all() and (np.diff(p) >= 0).all() and p.min() >= 0 and p.max() <= 1


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_logits_are_a_model_failure_never_a_decision(credit_entry, bad):
    calibrator = Calibrator(credit_entry.manifest)
    with pytest.raises(InferenceFailed) as excinfo:
        calibrator.probabilities(np.array([[0.0, 0.5], [0.0, bad]], np.float32))
    assert excinfo.value.code == "INTERNAL"
    with pytest.raises(InferenceFailed):
        calibrator.margins(np.array([[bad, 0.0]], np.float32))
