"""The declarative, versioned feature schema and its fitted parameters.

A schema file (TOML, e.g. ``config/credit-risk/feature-schema.toml``) says, per feature, its
type, unit, allowed range, sentinels meaning missing, default, transform, and whether it is
personal data. Fitting it on the training split adds the learned parameters (medians, means,
standard deviations, category vocabularies); the pair is a :class:`Preprocessing`, stored
with every model version as ``preprocessing.json``. Its SHA-256 over canonical JSON is the
``preprocessing_hash`` of the version triple, so training and serving compute it identically.
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Target(_Strict):
    """Which column is the label and which of its values is the positive class."""

    column: str
    positive: str


class NumericFeature(_Strict):
    """A numeric attribute: guards, then ``transform``, then standardisation."""

    name: str
    unit: str = ""
    min: float
    max: float
    sentinels: tuple[float, ...] = ()
    default: float | Literal["median"] = "median"
    transform: Literal["identity", "log1p"] = "identity"
    personal_data: bool = False

    @model_validator(mode="after")
    def _check_range(self) -> NumericFeature:
        if not self.min < self.max:
            raise ValueError(f"{self.name}: min must be below max")
        if self.transform == "log1p" and self.min < 0:
            raise ValueError(f"{self.name}: log1p needs min >= 0")
        return self


class CategoricalFeature(_Strict):
    """A categorical attribute: normalised, one-hot over the vocabulary plus an unknown slot."""

    name: str
    unit: str = ""
    normalize: Literal["trim_lower", "none"] = "trim_lower"
    default: str | Literal["mode"] = "mode"
    personal_data: bool = False


class FeatureSchema(_Strict):
    """A model family's feature schema, as written by hand."""

    name: str
    version: str
    source: str = ""
    target: Target
    entity_id_column: str = ""
    numeric: tuple[NumericFeature, ...] = ()
    categorical: tuple[CategoricalFeature, ...] = ()

    @model_validator(mode="after")
    def _unique_names(self) -> FeatureSchema:
        names = [f.name for f in (*self.numeric, *self.categorical)]
        if len(set(names)) != len(names):
            raise ValueError("feature names must be unique")
        return self

    @classmethod
    def from_toml(cls, path: Path) -> FeatureSchema:
        """Loads a schema file.

        Raises:
            OSError: the file cannot be read.
            pydantic.ValidationError: the file does not describe a valid schema.
        """
        with open(path, "rb") as f:
            return cls.model_validate(tomllib.load(f))

    @property
    def attribute_names(self) -> tuple[str, ...]:
        """Raw attribute names the schema reads, numeric first, in vector order."""
        return tuple(f.name for f in (*self.numeric, *self.categorical))

    @property
    def personal_data(self) -> frozenset[str]:
        """Names of attributes flagged as personal data (never logged raw)."""
        return frozenset(f.name for f in (*self.numeric, *self.categorical) if f.personal_data)


class NumericParams(_Strict):
    """Parameters fitted for one numeric feature on the training split."""

    default: float
    mean: float
    std: float = Field(gt=0)


class CategoricalParams(_Strict):
    """Parameters fitted for one categorical feature on the training split."""

    default: str
    vocabulary: tuple[str, ...]


def normalize_category(value: str, rule: str) -> str:
    """Applies a categorical feature's normalisation rule to a raw string."""
    return value.strip().lower() if rule == "trim_lower" else value


def is_missing(value: Any) -> bool:
    """True for the values that mean "missing": None and float NaN (pandas' missing)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


class Preprocessing(_Strict):
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

        Numeric values pass the same guards as at serving time before the statistics are
        taken, so training sees exactly the vectors that serving will build.

        Raises:
            ValueError: a feature has no usable value in ``rows``.
        """
        import numpy as np  # local: keeps import of this module light

        numeric: dict[str, NumericParams] = {}
        for feat in schema.numeric:
            present = [float(r[feat.name]) for r in rows if not is_missing(r.get(feat.name))]
            present = [v for v in present if v not in feat.sentinels]
            if not present:
                raise ValueError(f"{feat.name}: no values to fit on")
            default = float(np.median(present)) if feat.default == "median" else float(feat.default)
            guarded = np.clip(
                np.array([default if is_missing(r.get(feat.name)) or float(r[feat.name]) in feat.sentinels
                          else float(r[feat.name]) for r in rows]),
                feat.min, feat.max,
            )
            z = np.log1p(guarded) if feat.transform == "log1p" else guarded
            numeric[feat.name] = NumericParams(default=default, mean=float(z.mean()), std=float(z.std()) or 1.0)
        categorical: dict[str, CategoricalParams] = {}
        for feat in schema.categorical:
            seen = [normalize_category(str(r[feat.name]), feat.normalize)
                    for r in rows if not is_missing(r.get(feat.name))]
            seen = [v for v in seen if v]
            if not seen:
                raise ValueError(f"{feat.name}: no values to fit on")
            vocabulary = tuple(sorted(set(seen)))
            if feat.default == "mode":
                default = max(vocabulary, key=lambda v: (seen.count(v), v))
            else:
                default = normalize_category(feat.default, feat.normalize)
            categorical[feat.name] = CategoricalParams(default=default, vocabulary=vocabulary)
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

