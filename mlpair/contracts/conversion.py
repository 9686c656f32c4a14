"""Explicit conversion rules and guards for one raw attribute value.

Each schema feature declares how a wire value of each kind (number, string, boolean) becomes
its value (see :class:`~mlpair.contracts.schema.NumericFeature` and
:class:`~mlpair.contracts.schema.CategoricalFeature`). A value is converted by its rule or
refused with :class:`ConversionProblem`; it is never silently turned into a missing value.
Training (fitting) and serving (assembly) both call these functions, so they cannot disagree.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import numpy as np

from mlpair.contracts.schema import CategoricalFeature, NumericFeature, is_missing, normalize_category

# Guard actions; together with the feature name they form the stable reason code.
MISSING_DEFAULTED = "MISSING_DEFAULTED"
SENTINEL_DEFAULTED = "SENTINEL_DEFAULTED"
CLAMPED_MIN = "CLAMPED_MIN"
CLAMPED_MAX = "CLAMPED_MAX"
UNKNOWN_CATEGORY = "UNKNOWN_CATEGORY"

# A plain decimal: optional sign, ASCII digits with an optional fraction, optional exponent.
# Deliberately excludes "nan", "inf", "1_000" and "1,000", which float() would partly accept, and
# digits of other scripts ("١٢٩", full-width "１２９"), which float() reads as 129.
_DECIMAL = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?", re.ASCII)
_TRUE = frozenset({"true", "yes", "y", "1"})
_FALSE = frozenset({"false", "no", "n", "0"})


class ConversionProblem(ValueError):
    """A raw value that the feature's conversion rules do not accept; the message says why."""


def _kind(value: Any) -> str:
    """Plain-language type of a raw value, for error messages (never the value itself)."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float, np.integer, np.floating)):
        return "a number"
    return "a string" if isinstance(value, str) else type(value).__name__


def to_number(value: Any, feature: NumericFeature) -> float | None:
    """Converts a raw value by the feature's rules; None means missing.

    The result may still be a sentinel, out of range or infinite: :func:`guard_number` handles those.

    Raises:
        ConversionProblem: the value's kind is refused by the rules, or a string is not a decimal,
            or an ``integer`` feature gets a fraction, or a ``boolean`` feature gets anything but 0/1.
    """
    if type(value) is float:  # the wire's number: the common case, decided here as the branches below would
        if math.isnan(value):
            return None
        x = value
    elif is_missing(value):
        return None
    elif isinstance(value, str):
        text = value.strip()
        if not text:
            return None
        if feature.type == "boolean":
            word = text.lower()
            if word in _TRUE or word in _FALSE:
                return 1.0 if word in _TRUE else 0.0
            raise ConversionProblem("expected a yes/no flag, got a string that is not one")
        if feature.strings == "refuse":
            raise ConversionProblem("expected a number, got a string (this feature refuses strings)")
        if not _DECIMAL.fullmatch(text):
            raise ConversionProblem("expected a number, got a string that is not a plain decimal")
        x = float(text)
    elif isinstance(value, (bool, np.bool_)):
        if feature.type != "boolean":
            raise ConversionProblem("expected a number, got a boolean")
        return 1.0 if value else 0.0
    elif isinstance(value, (int, float, np.integer, np.floating)):
        x = float(value)
        if math.isnan(x):
            return None
    else:
        raise ConversionProblem(f"expected a number, got {_kind(value)}")
    if feature.type == "boolean" and x not in (0.0, 1.0):
        raise ConversionProblem("expected a yes/no flag (0 or 1), got another number")
    if feature.type == "integer" and math.isfinite(x) and not x.is_integer():
        raise ConversionProblem("expected a whole number, got a fraction")
    return x


def guard_number(x: float | None, feature: NumericFeature, default: float) -> tuple[float, str | None]:
    """Applies the guards in order: missing or sentinel → default; outside [min, max] → clamped.

    Infinities clamp like any huge value, so every result is finite and within [min, max].

    Returns:
        The guarded value and the guard action that fired (None when the value passed as is).
    """
    if x is None:
        return default, MISSING_DEFAULTED
    if x in feature.sentinels:
        return default, SENTINEL_DEFAULTED
    if x < feature.min:
        return feature.min, CLAMPED_MIN
    if x > feature.max:
        return feature.max, CLAMPED_MAX
    return x, None


def to_category(value: Any, feature: CategoricalFeature, missing: frozenset[str] | None = None) -> str | None:
    """Converts and normalises a raw value by the feature's rules; None means missing.

    Args:
        missing: ``missing_values(feature)``, when the caller keeps it at hand (it is looked up otherwise).

    Raises:
        ConversionProblem: a number or boolean where the rules refuse one, or a fractional number.
    """
    if type(value) is str:  # the wire's string: the common case, no rule below applies to it
        pass
    elif is_missing(value):
        return None
    elif isinstance(value, (bool, np.bool_)):
        if feature.booleans != "yes_no":
            raise ConversionProblem("expected a category string, got a boolean")
        value = "yes" if value else "no"
    elif isinstance(value, (int, float, np.integer, np.floating)):
        if feature.numbers != "integer_string":
            raise ConversionProblem("expected a category string, got a number")
        if not math.isfinite(float(value)) or not float(value).is_integer():
            raise ConversionProblem("expected a category code, got a number that is not a whole number")
        value = str(int(value))
    elif not isinstance(value, str):
        raise ConversionProblem(f"expected a category string, got {_kind(value)}")
    text = normalize_category(value, feature.normalize)
    if not text.strip() or text in (missing_values(feature) if missing is None else missing):
        return None
    return text


@functools.lru_cache(maxsize=256)
def missing_values(feature: CategoricalFeature) -> frozenset[str]:
    """The feature's ``missing_values`` after its normalisation (what :func:`to_category` compares)."""
    return frozenset(normalize_category(v, feature.normalize) for v in feature.missing_values)
