"""Fixtures for InferenceService tests: real holdout features and the version contract."""

from __future__ import annotations

import numpy as np
import pytest

from mlpair.contracts.assembly import FeatureAssembler

from tests.inference.helpers import VERSION_HEADER


@pytest.fixture(scope="session")
def holdout_x(credit_entry, credit_holdout) -> np.ndarray:
    """Every real holdout applicant as model input, ``[n, n_features] float32``."""
    return FeatureAssembler(credit_entry.preprocessing).assemble_many(credit_holdout.records)


@pytest.fixture(scope="session")
def feature_version(credit_entry) -> str:
    return credit_entry.manifest.versions.feature_schema_version


@pytest.fixture(scope="session")
def good_metadata(feature_version):
    return ((VERSION_HEADER, feature_version),)
