"""A feature schema fitted on the training split: the whole transformation of a model version.

Fitting a :class:`~mlpair.contracts.schema.FeatureSchema` adds the learned parameters
(defaults, means, standard deviations, category vocabularies); the pair is a
:class:`Preprocessing`, stored with every model version as ``preprocessing.json``. Its SHA-256
over canonical JSON is the ``preprocessing_hash`` of the version triple, so training and serving
compute it identically. Fitting converts and guards values by the schema's rules
(:mod:`mlpair.contracts.conversion`), as serving does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, model_validator

from mlpair.contracts.conversion import guard_number, to_category, to_number
from mlpair.contracts.schema import CategoricalFeature, FeatureSchema, NumericFeature, Strict, normalize_category


class NumericParams(Strict):
    """Parameters fitted for one numeric feature on the training split."""

    default: float
    mean: float
    std: float = Field(gt=0)


class CategoricalParams(Strict):
    """Parameters fitted for one categorical feature on the training split."""

    default: str
    vocabulary: tuple[str, ...]


class Preprocessing(Strict):
    """A schema plus the parameters fitted on the training split: the whole transformation."""

    feature_schema: FeatureSchema
    numeric: dict[str, NumericParams]
    categorical: dict[str, CategoricalParams]

    @model_validator(mode="after")
    def _params_cover_schema(self) -> Preprocessing:
        if set(self.numeric) != {f.name for f in self.feature_schema.numeric}:
            raise ValueError("numeric parameters do not match the schema's numeric features")
        if set(self.categorical) != {f.name for f in self.feature_schema.categorical}:
            raise ValueError("categorical parameters do not match the schema's categorical features")
        return self

    @classmethod
    def fit(cls, schema: FeatureSchema, rows: Sequence[Mapping[str, Any]]) -> Preprocessing:
        """Fits defaults, scaling statistics and vocabularies on raw training rows.

        Values pass the same conversion rules and guards as at serving time before the
        statistics are taken, so training sees exactly the vectors that serving will build.

        Raises:
            ValueError: a feature has no usable value in ``rows``, or a value no rule converts.
        """
        numeric = {feat.name: _fit_numeric(feat, rows) for feat in schema.numeric}
        categorical = {feat.name: _fit_categorical(feat, rows) for feat in schema.categorical}
        return cls(feature_schema=schema, numeric=numeric, categorical=categorical)

    @property
    def n_features(self) -> int:
        """Width of the feature vector: one per numeric, vocabulary + 1 unknown per categorical."""
        return len(self.numeric) + sum(len(p.vocabulary) + 1 for p in self.categorical.values())

    @property
    def feature_names(self) -> tuple[str, ...]:
        """Name of every column of the feature vector, e.g. ``Home=rent``, ``Home=<unknown>``."""
        names = [f.name for f in self.feature_schema.numeric]
        for feat in self.feature_schema.categorical:
            names += [f"{feat.name}={v}" for v in self.categorical[feat.name].vocabulary]
            names.append(f"{feat.name}=<unknown>")
        return tuple(names)

    def canonical_json(self) -> str:
        """Sorted-key, compact JSON: the bytes the preprocessing hash is taken over."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @property
    def hash(self) -> str:
        """``sha256:<hex>`` of :meth:`canonical_json`; the triple's preprocessing_hash."""
        return "sha256:" + hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def save(self, path: Path) -> None:
        """Writes the preprocessing as indented JSON (hash is over canonical JSON, not these bytes)."""
        path.write_text(json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: Path) -> Preprocessing:
        """Reads ``preprocessing.json``.

        Raises:
            OSError: unreadable file. pydantic.ValidationError: invalid content.
        """
        return cls.model_validate_json(path.read_text())


def _fit_numeric(feat: NumericFeature, rows: Sequence[Mapping[str, Any]]) -> NumericParams:
    """Default (median, mode or the schema's), then mean and standard deviation of the guarded,
    transformed values.

    Raises:
        ValueError: no usable value, or a value no rule converts.
    """
    converted = [to_number(r.get(feat.name), feat) for r in rows]
    present = [v for v in converted if v is not None and v not in feat.sentinels]
    if not present:
        raise ValueError(f"{feat.name}: no values to fit on")
    if feat.default == "median":
        default = float(np.median(present))
    elif feat.default == "mode":
        values, counts = np.unique(present, return_counts=True)
        default = float(values[np.argmax(counts)])  # ties: the smallest value
    else:
        default = float(feat.default)
    guarded = np.array([guard_number(v, feat, default)[0] for v in converted])
    z = np.log1p(guarded) if feat.transform == "log1p" else guarded
    return NumericParams(default=default, mean=float(z.mean()), std=float(z.std()) or 1.0)


def _fit_categorical(feat: CategoricalFeature, rows: Sequence[Mapping[str, Any]]) -> CategoricalParams:
    """Vocabulary (sorted) and default (the most frequent value, or the schema's, normalised).

    Raises:
        ValueError: no usable value, or a value no rule converts.
    """
    seen = [v for v in (to_category(r.get(feat.name), feat) for r in rows) if v is not None]
    if not seen:
        raise ValueError(f"{feat.name}: no values to fit on")
    vocabulary = tuple(sorted(set(seen)))
    if feat.default == "mode":
        default = max(vocabulary, key=lambda v: (seen.count(v), v))
    else:
        default = normalize_category(feat.default, feat.normalize)
    return CategoricalParams(default=default, vocabulary=vocabulary)
