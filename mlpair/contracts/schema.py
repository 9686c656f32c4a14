"""The declarative, versioned feature schema and its fitted parameters.

A schema file (TOML, e.g. ``config/credit-risk/feature-schema.toml``) says, per feature, its
type and conversion rules, unit, business label, allowed range, sentinels meaning missing,
default, transform, and whether it is personal data. Fitting it on the training split adds
the learned parameters (defaults, means, standard deviations, category vocabularies); the pair
is a :class:`Preprocessing`, stored with every model version as ``preprocessing.json``. Its
SHA-256 over canonical JSON is the ``preprocessing_hash`` of the version triple, so training
and serving compute it identically.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Largest finite float32; ranges beyond it could not survive the float32 cast.
FLOAT32_MAX = 3.4028234663852886e38


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def reason_prefix(name: str) -> str:
    """Stable reason-code prefix for a feature or phrase: ``"monthly charges"`` → ``MONTHLY_CHARGES``."""
    return re.sub(r"[^A-Z0-9]+", "_", name.upper()).strip("_")


class Target(_Strict):
    """Which column is the label, which of its values is the positive class, and its business name."""

    column: str
    positive: str
    outcome: str = ""
    """Business phrase for the positive class in explanations, e.g. "default risk"."""

    @property
    def outcome_phrase(self) -> str:
        return self.outcome or f"{self.column} = {self.positive}"


class NumericFeature(_Strict):
    """A numeric attribute: conversion, guards, then ``transform``, then standardisation.

    Conversion rules by ``type`` (anything else refuses the request, never a silent null):

    * ``real``: numbers as they are; strings by ``strings`` ("parse": a trimmed decimal such
      as ``"42"`` or ``"-1.5e3"``, never ``"nan"`` or ``"inf"``; "refuse"); booleans refused.
    * ``integer``: as ``real``, and the value must be a whole number (``2.5`` is refused).
    * ``boolean``: ``True``/``False``, the numbers 0 and 1, and the strings true/false, yes/no,
      y/n, 1/0 (trimmed, any case) → 1.0 / 0.0; range fixed to [0, 1].

    Missing: absent, null, NaN or an empty string → ``default`` with a ``MISSING_DEFAULTED`` guard.
    """

    name: str
    label: str = ""
    """Business name used in explanations; the attribute name when empty."""
    unit: str = ""
    type: Literal["real", "integer", "boolean"] = "real"
    strings: Literal["parse", "refuse"] = "parse"
    min: float
    max: float
    sentinels: tuple[float, ...] = ()
    default: float | Literal["median", "mode"] = "median"
    transform: Literal["identity", "log1p"] = "identity"
    personal_data: bool = False

    @model_validator(mode="before")
    @classmethod
    def _boolean_range(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") == "boolean":
            data = {"min": 0.0, "max": 1.0, **data}
        return data

    @model_validator(mode="after")
    def _check_range(self) -> NumericFeature:
        if not (math.isfinite(self.min) and math.isfinite(self.max)) or max(abs(self.min), abs(self.max)) > FLOAT32_MAX:
            raise ValueError(f"{self.name}: min and max must be finite float32 values")
        if not self.min < self.max:
            raise ValueError(f"{self.name}: min must be below max")
        if self.transform == "log1p" and self.min < 0:
            raise ValueError(f"{self.name}: log1p needs min >= 0")
        if self.type == "boolean" and (self.min, self.max) != (0.0, 1.0):
            raise ValueError(f"{self.name}: a boolean feature has min 0 and max 1")
        if isinstance(self.default, float) and not self.min <= self.default <= self.max:
            raise ValueError(f"{self.name}: default must lie in [min, max]")
        return self

    @property
    def display(self) -> str:
        return self.label or self.name


class CategoricalFeature(_Strict):
    """A categorical attribute: normalised, one-hot over the vocabulary plus an unknown slot.

    Conversion rules: strings as they are; numbers by ``numbers`` ("integer_string": a whole
    number becomes its decimal string, ``2.0`` → ``"2"``; "refuse"); booleans by ``booleans``
    ("yes_no": ``True`` → ``"yes"``, ``False`` → ``"no"``; "refuse"). Then ``normalize``
    ("trim_lower", "trim" or "none"). Missing: absent, null, an empty string after
    normalisation, or one of ``missing_values`` (compared after normalisation) → ``default``.
    A value outside the training vocabulary goes to the unknown slot, never to a real category.
    """

    name: str
    label: str = ""
    """Business name used in explanations; the attribute name when empty."""
    unit: str = ""
    normalize: Literal["trim_lower", "trim", "none"] = "trim_lower"
    numbers: Literal["refuse", "integer_string"] = "refuse"
    booleans: Literal["refuse", "yes_no"] = "refuse"
    missing_values: tuple[str, ...] = ()
    default: str | Literal["mode"] = "mode"
    personal_data: bool = False

    @property
    def display(self) -> str:
        return self.label or self.name


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
        names = [f.name for f in self.features]
        if len(set(names)) != len(names):
            raise ValueError("feature names must be unique")
        codes = [reason_prefix(n) for n in names]
        if len(set(codes)) != len(codes) or not all(codes):
            raise ValueError("feature names must give distinct, non-empty reason-code prefixes")
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
    def features(self) -> tuple[NumericFeature | CategoricalFeature, ...]:
        """Every feature, numeric first, in vector order."""
        return (*self.numeric, *self.categorical)

    @property
    def attribute_names(self) -> tuple[str, ...]:
        """Raw attribute names the schema reads, numeric first, in vector order."""
        return tuple(f.name for f in self.features)

    @property
    def personal_data(self) -> frozenset[str]:
        """Names of attributes flagged as personal data (never logged raw)."""
        return frozenset(f.name for f in self.features if f.personal_data)


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
    if rule == "trim_lower":
        return value.strip().lower()
    return value.strip() if rule == "trim" else value


def is_missing(value: Any) -> bool:
    """True for the values that mean "missing" before any rule: None and float NaN (pandas' missing)."""
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

        Values pass the same conversion rules and guards as at serving time before the
        statistics are taken, so training sees exactly the vectors that serving will build.

        Raises:
            ValueError: a feature has no usable value in ``rows``, or a value no rule converts.
        """
        import numpy as np  # local: keeps import of this module light

        from mlpair.contracts.conversion import guard_number, to_category, to_number

        numeric: dict[str, NumericParams] = {}
        for feat in schema.numeric:
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
            numeric[feat.name] = NumericParams(default=default, mean=float(z.mean()), std=float(z.std()) or 1.0)
        categorical: dict[str, CategoricalParams] = {}
        for feat in schema.categorical:
            seen = [v for v in (to_category(r.get(feat.name), feat) for r in rows) if v is not None]
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
