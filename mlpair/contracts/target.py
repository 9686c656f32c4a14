"""Which model scores a row: the one value PredictionService's scoring path passes down to InferenceService."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelTarget:
    """A model family, its pinned version and the feature schema version its rows were built for.

    Hashable: it keys the cache's entries (:func:`~mlpair.prediction.scoring.cache.cache_key`) and
    the coalescer's lanes, so rows of another model, version or schema never share either.

    Attributes:
        name: model family name (``model_name`` of an Infer call, and the metric label).
        version: model version to run ("" lets InferenceService choose its default).
        feature_version: feature schema version, sent as ``x-feature-version``
            (:data:`mlpair.contracts.FEATURE_VERSION_KEY`).
    """

    name: str
    version: str
    feature_version: str
