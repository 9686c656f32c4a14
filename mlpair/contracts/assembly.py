"""Feature assembly: raw business attributes → guarded ``[n_features] float32`` vectors.

The rules used by training (on the training split) and by PredictionService (on live requests),
so there is no training/serving skew: :meth:`FeatureAssembler.assemble` is one record's path, and
many records go through :class:`~mlpair.contracts.columns.ColumnAssembler` (the same rules a
column at a time, this path inside it for a few records). Each value is first converted by its
feature's explicit rules (:mod:`mlpair.contracts.conversion`); a value no rule converts is a
:class:`ConversionError` and the whole request is refused with every such attribute named at
once. Guards never raise for a convertible value: missing and sentinel values take the schema
default, out-of-range values (huge, negative, infinite) are clamped before the float32 cast,
unknown categories go to the unknown slot, and every such action is reported as a
:class:`GuardEvent` with a stable reason code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlpair.contracts.conversion import (  # noqa: F401  (actions re-exported for callers)
    CLAMPED_MAX,
    CLAMPED_MIN,
    MISSING_DEFAULTED,
    SENTINEL_DEFAULTED,
    UNKNOWN_CATEGORY,
    ConversionProblem,
    guard_number,
    missing_values,
    to_category,
    to_number,
)
from mlpair.contracts.preprocessing import Preprocessing
from mlpair.contracts.schema import reason_prefix


@dataclass(frozen=True, slots=True)
class GuardEvent:
    """One guard that fired on one feature."""

    feature: str
    action: str

    @property
    def reason_code(self) -> str:
        """Stable machine-readable code, e.g. ``INCOME_SENTINEL_DEFAULTED``."""
        return f"{reason_prefix(self.feature)}_{self.action}"


@dataclass(frozen=True, slots=True)
class AssembledRow:
    """One assembled vector with what the guards did and which attributes were ignored."""

    vector: np.ndarray  # [n_features] float32
    guards: tuple[GuardEvent, ...] = ()
    unknown_attributes: tuple[str, ...] = ()


@dataclass
class ConversionError(ValueError):
    """Attribute values that no conversion rule accepts; ``problems`` maps attribute → message."""

    problems: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return "; ".join(f"{name}: {msg}" for name, msg in sorted(self.problems.items()))


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
            (f, preprocessing.numeric[f.name], 1.0 / preprocessing.numeric[f.name].std) for f in schema.numeric
        ]
        self._categorical = []
        slices: dict[str, slice] = {f.name: slice(i, i + 1) for i, f in enumerate(schema.numeric)}
        offset = len(self._numeric)
        for f in schema.categorical:
            params = preprocessing.categorical[f.name]
            index = {v: offset + i for i, v in enumerate(params.vocabulary)}
            unknown = offset + len(params.vocabulary)
            self._categorical.append((f, index, unknown, params.default, missing_values(f)))
            slices[f.name] = slice(offset, unknown + 1)
            offset = unknown + 1
        self.feature_slices: dict[str, slice] = slices
        """Schema feature name → the columns it occupies in the vector (in schema order)."""
        self._known = frozenset(schema.attribute_names)
        self.default_vector = self.assemble({}).vector
        """``[n_features] float32``: every feature at its schema default (the occlusion baseline)."""

    def assemble(self, attributes: Mapping[str, Any]) -> AssembledRow:
        """Assembles one raw record; attribute order never matters.

        Args:
            attributes: attribute name → value (number, string, bool or None/NaN for missing).

        Returns:
            The ``[n_features] float32`` vector, guard events and ignored attribute names.

        Raises:
            ConversionError: naming every attribute whose value no conversion rule accepts.
        """
        out = [0.0] * self.n_features  # Python floats, cast to float32 once at the end
        guards: list[GuardEvent] = []
        problems: dict[str, str] = {}
        for i, (feat, params, inv_std) in enumerate(self._numeric):
            try:
                raw = to_number(attributes.get(feat.name), feat)
            except ConversionProblem as exc:
                problems[feat.name] = str(exc)
                continue
            x, action = guard_number(raw, feat, params.default)
            if action is not None:
                guards.append(GuardEvent(feat.name, action))
            if feat.transform == "log1p":
                x = math.log1p(x)
            out[i] = (x - params.mean) * inv_std
        for cat, index, unknown, default, missing in self._categorical:
            try:
                value = to_category(attributes.get(cat.name), cat, missing)
            except ConversionProblem as exc:
                problems[cat.name] = str(exc)
                continue
            if value is None:
                value = default
                guards.append(GuardEvent(cat.name, MISSING_DEFAULTED))
            slot = index.get(value)
            if slot is None:
                slot = unknown
                guards.append(GuardEvent(cat.name, UNKNOWN_CATEGORY))
            out[slot] = 1.0
        if problems:
            raise ConversionError(problems)
        # most records carry only schema attributes: one set comparison instead of a scan
        unknown_attrs = (
            () if attributes.keys() <= self._known else tuple(sorted(k for k in attributes if k not in self._known))
        )
        return AssembledRow(np.array(out, dtype=np.float32), tuple(guards), unknown_attrs)

    def assemble_many(self, rows: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """Assembles raw records into ``[len(rows), n_features] float32`` (training's path) through
        the assembler PredictionService uses for every call (:class:`~mlpair.contracts.columns.ColumnAssembler`).

        Raises:
            ConversionError: for the first row with an unconvertible value.
        """
        from mlpair.contracts.columns import ColumnAssembler  # it builds on this class

        assembled = ColumnAssembler(self).assemble(rows)
        if assembled.problems:
            raise ConversionError(assembled.problems[min(assembled.problems)])
        return assembled.matrix

    def occlusions(self, vector: np.ndarray) -> np.ndarray:
        """One copy of ``vector`` per schema feature with that feature set to its schema default.

        Args:
            vector: ``[n_features] float32``, an assembled row.

        Returns:
            ``[n_schema_features, n_features] float32``, rows in schema order (numeric first).
        """
        rows = np.repeat(vector[None, :], len(self.feature_slices), axis=0)
        for k, cols in enumerate(self.feature_slices.values()):
            rows[k, cols] = self.default_vector[cols]
        return rows
