"""The feature assembler for many records: raw attributes → one guarded ``[rows, n_features] float32`` matrix.

Training (:meth:`FeatureAssembler.assemble_many <mlpair.contracts.assembly.FeatureAssembler.assemble_many>`)
and PredictionService (every call's rows) assemble through :class:`ColumnAssembler`; fewer than
:data:`SMALL_BATCH` records go row by row inside it through :meth:`FeatureAssembler.assemble
<mlpair.contracts.assembly.FeatureAssembler.assemble>` (NumPy's cost per call would outweigh a
column's work). The same conversion rules, guards and arithmetic either way, applied a feature
at a time over every row instead of a row at a time over every feature. Bit-identical by
construction, and checked against the row-wise path on the real holdout and on generated records
(``tests/contracts/test_columns.py``):

* numbers: a column whose values are all wire numbers or missing is one float64 array (None
  and NaN are missing); any other column converts value by value with the shared
  :func:`~mlpair.contracts.conversion.to_number`. Guards in the same order (missing, sentinel,
  below min, above max), then ``log1p`` through :func:`math.log1p` (NumPy's vectorised log1p
  may round differently), then ``(x - mean) * (1 / std)`` in float64 and one cast to float32;
* categories: each distinct string is converted once (:func:`~mlpair.contracts.conversion.to_category`)
  and its slot remembered, so a column costs one dictionary look-up per row;
* guards are kept as one bit mask per (row, schema feature) (:data:`ACTION_BITS`) and turned
  into :class:`~mlpair.contracts.assembly.GuardEvent` tuples only for rows where one fired.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlpair.contracts.assembly import (
    CLAMPED_MAX,
    CLAMPED_MIN,
    MISSING_DEFAULTED,
    SENTINEL_DEFAULTED,
    UNKNOWN_CATEGORY,
    ConversionError,
    FeatureAssembler,
    GuardEvent,
)
from mlpair.contracts.conversion import ConversionProblem, to_category, to_number

# One bit per guard action; a feature's events are listed in this order (the row-wise order).
ACTION_BITS = {MISSING_DEFAULTED: 1, SENTINEL_DEFAULTED: 2, CLAMPED_MIN: 4, CLAMPED_MAX: 8, UNKNOWN_CATEGORY: 16}
DEFAULTED_BITS = ACTION_BITS[MISSING_DEFAULTED] | ACTION_BITS[SENTINEL_DEFAULTED]
SMALL_BATCH = 8  # fewer rows than this, given without their columns, are assembled row by row
_MEMO_LIMIT = 4096  # distinct strings remembered per categorical feature (clients cannot grow it without bound)
_NUMBER_TYPES = frozenset({float, type(None)})


@dataclass(frozen=True)
class AttributeColumns:
    """A batch's attribute values column by column, read once for its fingerprints and its assembly.

    Attributes:
        names: the attribute names read, distinct, in order.
        values: one list per name, a value per record (None where the record lacks the name).
        others: positions of the records holding an attribute that is not among ``names``.
    """

    names: list[str]
    values: list[list]
    others: list[int]


def attribute_columns(records: Sequence[Mapping[str, Any]], names: list[str]) -> AttributeColumns:
    """``records``' values of each of ``names`` (distinct), column by column, and which records
    hold other attributes."""
    read = set(names)
    return AttributeColumns(
        names,
        [[r.get(name) for r in records] for name in names],
        [i for i, r in enumerate(records) if not r.keys() <= read],
    )


@dataclass(frozen=True)
class RowGuards:
    """What the guards did to one row: events in row-wise order, their distinct reason codes, how
    many schema features took their default (missing or sentinel) and which."""

    events: tuple[GuardEvent, ...]
    reason_codes: tuple[str, ...]
    defaulted: int
    defaulted_features: frozenset[str] = frozenset()


NO_GUARDS = RowGuards((), (), 0)
DEFAULTED_ACTIONS = frozenset({MISSING_DEFAULTED, SENTINEL_DEFAULTED})  # the value was absent: a default stood in


@dataclass
class AssembledColumns:
    """Many rows assembled at once.

    Attributes:
        matrix: ``[rows, n_features] float32``; a refused row's values are meaningless.
        actions: ``[rows, n_schema_features] uint8`` guard bits (:data:`ACTION_BITS`).
        problems: row → attribute → message, for rows no conversion rule accepts (refused).
        unknown: row → attribute names the schema does not know, for rows that carry any.
    """

    matrix: np.ndarray
    actions: np.ndarray
    problems: dict[int, dict[str, str]]
    unknown: dict[int, tuple[str, ...]]


class ColumnAssembler:
    """Assembles many raw records at once for one :class:`FeatureAssembler` (same vectors, same guards)."""

    def __init__(self, assembler: FeatureAssembler) -> None:
        self.assembler = assembler
        schema = assembler.preprocessing.feature_schema
        self.features = schema.features
        self.n_features = assembler.n_features
        self._known = frozenset(schema.attribute_names)
        self.attribute_names = sorted(self._known)
        """The schema's attribute names, sorted: the columns :meth:`columns` reads (the canonical
        request text of a fingerprint lists attributes in this order)."""
        # the attributes assembled, in the assembler's order (its numeric features, then its
        # categorical ones), as positions in attribute_names
        self._read = [
            self.attribute_names.index(name)
            for name in [feat.name for feat, _, _ in assembler._numeric]
            + [spec[0].name for spec in assembler._categorical]
        ]
        self._categorical_memo: list[dict[str, int]] = [{} for _ in schema.categorical]  # value → slot << 5 | bits
        self._row_guards: dict[bytes, RowGuards] = {}
        self._decoded_bits = [(bit, action) for action, bit in ACTION_BITS.items()]
        self._feature_at = {feat.name: k for k, feat in enumerate(self.features)}

    def columns(self, records: Sequence[Mapping[str, Any]]) -> AttributeColumns:
        """``records``' values of :attr:`attribute_names`, for :meth:`assemble` and
        :func:`~mlpair.prediction.preparing.idempotency.request_fingerprints` (PredictionService) to share."""
        return attribute_columns(records, self.attribute_names)

    def assemble(
        self, records: Sequence[Mapping[str, Any]], columns: AttributeColumns | None = None
    ) -> AssembledColumns:
        """Assembles ``records`` (attribute name → float, str, bool or None) into one matrix.

        Args:
            columns: ``records``' :meth:`columns`, when the caller has read them already.

        Returns:
            The matrix, guard bits, conversion problems and unknown attributes per row
            (:class:`AssembledColumns`); never raises for a row's values.

        Fewer than :data:`SMALL_BATCH` records given without their columns go row by row through
        the shared :class:`FeatureAssembler` (NumPy's cost per call would outweigh a column's
        work); the result, guard bits included, is the same either way.
        """
        n = len(records)
        if columns is None and n < SMALL_BATCH:
            return self._row_by_row(records)
        matrix = np.zeros((n, self.n_features), dtype=np.float32)
        actions = np.zeros((n, len(self.features)), dtype=np.uint8)
        problems: dict[int, dict[str, str]] = {}
        table = columns if columns is not None else self.columns(records)
        values = [table.values[j] for j in self._read]
        numeric = self.assembler._numeric
        for k, (feat, params, inv_std) in enumerate(numeric):
            self._numeric(k, feat, params, inv_std, values[k], matrix, actions, problems)
        offset = len(numeric)
        for j, spec in enumerate(self.assembler._categorical):
            self._categorical(
                offset + j, spec, self._categorical_memo[j], values[offset + j], matrix, actions, problems
            )
        known = self._known
        unknown = {i: tuple(sorted(a for a in records[i] if a not in known)) for i in table.others}
        return AssembledColumns(matrix, actions, problems, unknown)

    def _row_by_row(self, records: Sequence[Mapping[str, Any]]) -> AssembledColumns:
        """:meth:`assemble` of a few records, one at a time: each row's guard events set its bits."""
        matrix = np.zeros((len(records), self.n_features), dtype=np.float32)
        actions = np.zeros((len(records), len(self.features)), dtype=np.uint8)
        problems: dict[int, dict[str, str]] = {}
        unknown: dict[int, tuple[str, ...]] = {}
        for i, record in enumerate(records):
            try:
                row = self.assembler.assemble(record)
            except ConversionError as exc:
                problems[i] = exc.problems
                continue
            matrix[i] = row.vector
            for event in row.guards:
                actions[i, self._feature_at[event.feature]] |= ACTION_BITS[event.action]
            if row.unknown_attributes:
                unknown[i] = row.unknown_attributes
        return AssembledColumns(matrix, actions, problems, unknown)

    def guards(self, actions: np.ndarray) -> list[RowGuards]:
        """Each row's :class:`RowGuards` from its guard bits ``[rows, n_schema_features] uint8``."""
        out = [NO_GUARDS] * len(actions)
        if not len(actions):
            return out
        memo = self._row_guards
        for i in np.flatnonzero(actions.any(axis=1)).tolist():
            key = actions[i].tobytes()
            found = memo.get(key)
            if found is None:
                found = self._decode(actions[i])
                if len(memo) < _MEMO_LIMIT:
                    memo[key] = found
            out[i] = found
        return out

    def _decode(self, bits: np.ndarray) -> RowGuards:
        events = tuple(
            GuardEvent(feat.name, action)
            for feat, b in zip(self.features, bits.tolist())
            if b
            for bit, action in self._decoded_bits
            if b & bit
        )
        defaulted = frozenset(e.feature for e in events if e.action in DEFAULTED_ACTIONS)
        return RowGuards(events, tuple(dict.fromkeys(e.reason_code for e in events)), len(defaulted), defaulted)

    @staticmethod
    def _numeric(
        k: int,
        feat,
        params,
        inv_std: float,
        values: list,
        matrix: np.ndarray,
        actions: np.ndarray,
        problems: dict[int, dict[str, str]],
    ) -> None:
        if set(map(type, values)) <= _NUMBER_TYPES:  # wire numbers and missing: one array
            x = np.array(values, dtype=np.float64)  # None → NaN: missing, as to_number says
            bad = np.zeros(len(values), dtype=bool)
            present = ~np.isnan(x)
            if feat.type == "boolean":
                bad = present & (x != 0.0) & (x != 1.0)
                message = "expected a yes/no flag (0 or 1), got another number"
            elif feat.type == "integer":
                finite = np.isfinite(x)
                bad = finite & (np.floor(np.where(finite, x, 0.0)) != x)
                message = "expected a whole number, got a fraction"
            for i in np.flatnonzero(bad).tolist():
                problems.setdefault(i, {})[feat.name] = message
        else:
            x = np.empty(len(values), dtype=np.float64)
            for i, value in enumerate(values):
                try:
                    raw = to_number(value, feat)
                except ConversionProblem as exc:
                    problems.setdefault(i, {})[feat.name] = str(exc)
                    raw = None
                x[i] = math.nan if raw is None else raw
        missing = np.isnan(x)
        bits = np.where(missing, ACTION_BITS[MISSING_DEFAULTED], 0).astype(np.uint8)
        if feat.sentinels:
            sentinel = ~missing & np.isin(x, np.array(feat.sentinels, dtype=np.float64))
            bits[sentinel] = ACTION_BITS[SENTINEL_DEFAULTED]
            missing |= sentinel
        x = np.where(missing, params.default, x)
        low, high = ~missing & (x < feat.min), ~missing & (x > feat.max)
        bits[low] = ACTION_BITS[CLAMPED_MIN]
        bits[high] = ACTION_BITS[CLAMPED_MAX]
        x = np.where(low, feat.min, np.where(high, feat.max, x))
        if feat.transform == "log1p":
            x = np.fromiter(map(math.log1p, x.tolist()), dtype=np.float64, count=len(x))
        matrix[:, k] = (x - params.mean) * inv_std
        actions[:, k] = bits

    @staticmethod
    def _categorical(
        k: int,
        spec,
        memo: dict[str, int],
        values: list,
        matrix: np.ndarray,
        actions: np.ndarray,
        problems: dict[int, dict[str, str]],
    ) -> None:
        feat, index, unknown, default, missing = spec

        def convert(value: Any) -> tuple[int, int]:
            bits = 0
            category = to_category(value, feat, missing)
            if category is None:
                category, bits = default, ACTION_BITS[MISSING_DEFAULTED]
            slot = index.get(category)
            if slot is None:
                slot, bits = unknown, bits | ACTION_BITS[UNKNOWN_CATEGORY]
            return slot, bits

        # each value's slot and guard bits as one code, slot << 5 | bits (the bits are under 32);
        # the memo holds strings only, so any other value (a number, a flag, None) misses it
        try:
            codes: list[int | None] = list(map(memo.get, values))
        except TypeError:  # an unhashable value: every value converted below
            codes = [None] * len(values)
        if None in codes:
            for i in [i for i, code in enumerate(codes) if code is None]:
                value = values[i]
                try:
                    slot, bits = convert(value)
                except ConversionProblem as exc:
                    problems.setdefault(i, {})[feat.name] = str(exc)
                    codes[i] = unknown << 5
                    continue
                code = codes[i] = slot << 5 | bits
                if type(value) is str and len(memo) < _MEMO_LIMIT:
                    memo[value] = code
        found = np.array(codes, dtype=np.intp)
        matrix[np.arange(len(values)), found >> 5] = 1.0
        actions[:, k] = found & 0x1F
