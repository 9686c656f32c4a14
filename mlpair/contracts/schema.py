"""The declarative, versioned feature schema, as written by hand.

A schema file (TOML, e.g. ``config/credit-risk/feature-schema.toml``) says, per feature, its
type and conversion rules, unit, business label, allowed range, sentinels meaning missing,
default, transform, and whether it is personal data. The rules are applied by
:mod:`mlpair.contracts.conversion`; fitting the schema on the training split gives a
:class:`~mlpair.contracts.preprocessing.Preprocessing`.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

# Largest finite float32; ranges beyond it could not survive the float32 cast.
FLOAT32_MAX = 3.4028234663852886e38


class Strict(BaseModel):
    """A frozen model that refuses fields it does not declare (every schema and parameter class)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def reason_prefix(name: str) -> str:
    """Stable reason-code prefix for a feature or phrase: ``"monthly charges"`` → ``MONTHLY_CHARGES``."""
    return re.sub(r"[^A-Z0-9]+", "_", name.upper()).strip("_")


class Target(Strict):
    """Which column is the label, which of its values is the positive class, and its business name."""

    column: str
    positive: str
    outcome: str = ""
    """Business phrase for the positive class in explanations, e.g. "default risk"."""

    @property
    def outcome_phrase(self) -> str:
        """The positive class in words for explanations: ``outcome``, else ``"<column> = <positive>"``."""
        return self.outcome or f"{self.column} = {self.positive}"


class NumericFeature(Strict):
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
        """The name explanations use: ``label``, else the attribute name."""
        return self.label or self.name


class CategoricalFeature(Strict):
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
        """The name explanations use: ``label``, else the attribute name."""
        return self.label or self.name


class FeatureSchema(Strict):
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


def normalize_category(value: str, rule: str) -> str:
    """Applies a categorical feature's normalisation rule to a raw string."""
    if rule == "trim_lower":
        return value.strip().lower()
    return value.strip() if rule == "trim" else value


def is_missing(value: Any) -> bool:
    """True for the values that mean "missing" before any rule: None and float NaN (pandas' missing)."""
    return value is None or (isinstance(value, float) and math.isnan(value))
