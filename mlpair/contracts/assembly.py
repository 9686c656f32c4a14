"""Feature assembly: raw business attributes → guarded ``[n_features] float32`` vectors.

The one code path used by training (on the training split) and by PredictionService (on
live requests), so there is no training/serving skew. Guards never raise for a value of the
right type: missing and sentinel values take the schema default, out-of-range values are
clamped, unknown categories go to the unknown slot, and every such action is reported as a
:class:`GuardEvent` with a stable reason code. A value of a type no rule converts (a word
for a number, a number for a category) is a :class:`ConversionError` and the whole request
is refused with every such attribute named at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlpair.contracts.schema import Preprocessing, is_missing, normalize_category

# Guard actions; together with the feature name they form the stable reason code.
MISSING_DEFAULTED = "MISSING_DEFAULTED"
SENTINEL_DEFAULTED = "SENTINEL_DEFAULTED"
CLAMPED_MIN = "CLAMPED_MIN"
CLAMPED_MAX = "CLAMPED_MAX"
UNKNOWN_CATEGORY = "UNKNOWN_CATEGORY"


@dataclass(frozen=True, slots=True)
class GuardEvent:
    """One guard that fired on one feature."""

    feature: str
    action: str

    @property
    def reason_code(self) -> str:
        """Stable machine-readable code, e.g. ``INCOME_SENTINEL_DEFAULTED``."""
        return f"{self.feature.upper()}_{self.action}"


@dataclass(frozen=True, slots=True)
class AssembledRow:
    """One assembled vector with what the guards did and which attributes were ignored."""

    vector: np.ndarray  # [n_features] float32
    guards: tuple[GuardEvent, ...] = ()
    unknown_attributes: tuple[str, ...] = ()


@dataclass
class ConversionError(ValueError):
    """Attribute values whose type no rule converts; ``problems`` maps attribute → message."""

    problems: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return "; ".join(f"{name}: {msg}" for name, msg in sorted(self.problems.items()))


def _to_float(value: Any) -> float:
    """Explicit numeric conversion rule: numbers as they are; decimal strings parsed.

    Raises:
        TypeError: booleans and other types. ValueError: a string that is not a number.
    """
    if isinstance(value, bool):
        raise TypeError("expected a number, got a boolean")
    if isinstance(value, (int, float, np.integer, np.floating)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise ValueError("expected a number, got a string that is not one") from None
    raise TypeError(f"expected a number, got {_kind(value)}")


def _kind(value: Any) -> str:
    """Plain-language type of a raw value, for error messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float, np.integer, np.floating)):
        return "a number"
    return "a string" if isinstance(value, str) else type(value).__name__


class FeatureAssembler:
    """Builds feature vectors for one :class:`Preprocessing`.

    Layout of the vector (``Preprocessing.feature_names``): one standardised column per
    numeric feature in schema order, then per categorical feature a one-hot block over its
    training vocabulary followed by one unknown slot.
    """

    def __init__(self, preprocessing: Preprocessing) -> None:
        self.preprocessing = preprocessing
        self.n_features = preprocessing.n_features
        schema = preprocessing.feature_schema
        self._numeric = [
            (f.name, f.min, f.max, frozenset(f.sentinels), f.transform == "log1p",
             preprocessing.numeric[f.name].default, preprocessing.numeric[f.name].mean,
             1.0 / preprocessing.numeric[f.name].std)
            for f in schema.numeric
        ]
        self._categorical = []
        offset = len(self._numeric)
        for f in schema.categorical:
            params = preprocessing.categorical[f.name]
            index = {v: offset + i for i, v in enumerate(params.vocabulary)}
            unknown = offset + len(params.vocabulary)
            self._categorical.append((f.name, f.normalize, index, unknown, params.default))
            offset = unknown + 1
        self._known = frozenset(schema.attribute_names)

    def assemble(self, attributes: Mapping[str, Any]) -> AssembledRow:
        """Assembles one raw record; attribute order never matters.

        Args:
            attributes: attribute name → value (number, string, bool or None/NaN for missing).

        Returns:
            The ``[n_features] float32`` vector, guard events and ignored attribute names.

        Raises:
            ConversionError: naming every attribute whose value has an unconvertible type.
        """
        out = np.zeros(self.n_features, dtype=np.float32)
        guards: list[GuardEvent] = []
        problems: dict[str, str] = {}
        for i, (name, lo, hi, sentinels, log1p, default, mean, inv_std) in enumerate(self._numeric):
            raw = attributes.get(name)
            if is_missing(raw):
                x = default
                guards.append(GuardEvent(name, MISSING_DEFAULTED))
            else:
                try:
                    x = _to_float(raw)
                except (TypeError, ValueError) as exc:
                    problems[name] = str(exc)
                    continue
                if math.isnan(x):
                    x = default
                    guards.append(GuardEvent(name, MISSING_DEFAULTED))
                elif x in sentinels:
                    x = default
                    guards.append(GuardEvent(name, SENTINEL_DEFAULTED))
                elif x < lo:
                    x = lo
                    guards.append(GuardEvent(name, CLAMPED_MIN))
                elif x > hi:
                    x = hi
                    guards.append(GuardEvent(name, CLAMPED_MAX))
            if log1p:
                x = math.log1p(x)
            out[i] = (x - mean) * inv_std
        for name, rule, index, unknown, default in self._categorical:
            raw = attributes.get(name)
            if not is_missing(raw) and not isinstance(raw, str):
                problems[name] = f"expected a category string, got {_kind(raw)}"
                continue
            value = "" if is_missing(raw) else normalize_category(raw, rule)
            if not value:
                value = default
                guards.append(GuardEvent(name, MISSING_DEFAULTED))
            slot = index.get(value)
            if slot is None:
                slot = unknown
                guards.append(GuardEvent(name, UNKNOWN_CATEGORY))
            out[slot] = 1.0
        if problems:
            raise ConversionError(problems)
        unknown_attrs = tuple(sorted(k for k in attributes if k not in self._known))
        return AssembledRow(out, tuple(guards), unknown_attrs)

    def assemble_many(self, rows: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """Assembles raw records into ``[len(rows), n_features] float32`` (training's path).

        Raises:
            ConversionError: for the first row with an unconvertible value.
        """
        matrix = np.zeros((len(rows), self.n_features), dtype=np.float32)
        for k, row in enumerate(rows):
            matrix[k] = self.assemble(row).vector
        return matrix
