"""The idempotency key's payload check: a canonical fingerprint of what a request asks for.

A request id names one decision. A retry (same id, same payload) gets the recorded decision; the
same id with another payload is a caller's bug — or two callers sharing ids — and is refused
(``IDEMPOTENCY_KEY_REUSED``) instead of being answered with a decision about somebody else. The
payload is compared through :func:`request_fingerprint` over the values as the family's feature
schema reads them (:class:`SchemaReading`), so encodings the contract treats as equal compare
equal: attribute order, every spelling of a missing value (absent, null, NaN, empty string), and
every spelling the schema's conversion rules turn into one value (``-0.0`` and ``0.0``, ``30.0``
and ``"30"``, ``" OWNER "`` and ``"owner"``, ``True`` and ``"yes"`` where the schema says so;
README "Feature schema, conversion rules and guards"). Two values the rules read apart stay apart.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from mlpair.contracts.columns import AttributeColumns, attribute_columns
from mlpair.contracts.conversion import ConversionProblem, missing_values, to_category, to_number
from mlpair.contracts.schema import FeatureSchema

_CANONICAL = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_NUMBER_TYPES = frozenset({float, type(None)})
_FRAGMENT_LIMIT = 8192  # distinct values remembered per attribute (and per family: SchemaReading.fragments)
_ESCAPED = re.compile(r'["\\\x00-\x1f]')  # what the JSON encoder escapes (ensure_ascii=False)
_MEMO_LIMIT = 4096  # distinct strings remembered per categorical feature (clients cannot grow it without bound)


class SchemaReading:
    """What one family's feature schema reads each attribute value as: the values a request's
    fingerprint is taken over (:func:`request_fingerprint`).

    The schema's conversion rules (:mod:`mlpair.contracts.conversion`), and nothing after them:

    * a numeric feature's value → :func:`~mlpair.contracts.conversion.to_number`'s float (a decimal
      string its number, a boolean feature's flag or yes/no word 1.0 or 0.0), ``-0.0`` as ``0.0``;
    * a categorical feature's value → :func:`~mlpair.contracts.conversion.to_category`'s
      normalised string (trimmed and lower-cased under ``trim_lower``; a flag ``"yes"``/``"no"``
      under ``booleans = "yes_no"``; a whole number its digits under ``numbers = "integer_string"``);
    * missing (absent, null, NaN, an empty string, a category's ``missing_values``) → None;
    * an attribute the schema does not read, or a value no rule converts (the request is refused,
      so never recorded) → as sent, ``-0.0`` as ``0.0``.

    Guards are not applied: a sentinel is not an absent value, an out-of-range number is not its
    bound and an unknown category is not another unknown one — each gives its own reason codes,
    so a decision about one is not a decision about the other.
    """

    __slots__ = ("_categorical", "_fragments", "_memo", "_numeric")

    def __init__(self, schema: FeatureSchema) -> None:
        self._numeric = {f.name: f for f in schema.numeric}
        self._categorical = {f.name: (f, missing_values(f)) for f in schema.categorical}
        # per categorical feature: a string as sent → what the schema reads ("" for missing, so
        # that a look-up's None means "not remembered"; the canonical texts leave "" out as missing)
        self._memo: dict[str, dict[str, str]] = {f.name: {} for f in schema.categorical}
        # per schema attribute: its canonical fragments, remembered across calls
        self._fragments = {name: _Fragments(name) for name in schema.attribute_names}

    def fragments(self, name: str) -> _Fragments:
        """Attribute ``name``'s canonical fragments (:func:`request_fingerprints`), remembered for a
        schema attribute, new for another."""
        return self._fragments.get(name) or _Fragments(name)

    def value(self, name: str, value: Any) -> Any:
        """One attribute's value as the schema reads it (float, str, None for missing, or as sent)."""
        spec = self._categorical.get(name)
        if spec is not None:
            if type(value) is str:
                return self._category(self._memo[name], spec, value) or None
            try:
                return to_category(value, *spec)
            except ConversionProblem:
                return value
        feature = self._numeric.get(name)
        if feature is not None and type(value) is not float:
            try:
                number = to_number(value, feature)
            except ConversionProblem:
                return value
            return None if number is None else number + 0.0
        return value + 0.0 if type(value) is float else value  # + 0.0: -0.0 → 0.0, the rest unchanged

    def record(self, attributes: Mapping[str, Any]) -> dict[str, Any]:
        """``attributes`` (name → value) with each value as :meth:`value` reads it."""
        memo = self._memo
        out = {}
        for name, value in attributes.items():
            kind = type(value)
            if kind is float and name not in memo:  # a number read as a number: the wire's common case
                out[name] = value + 0.0
            elif kind is str and name in memo and (found := memo[name].get(value)) is not None:
                out[name] = found or None
            else:
                out[name] = self.value(name, value)
        return out

    def columns(self, table: AttributeColumns) -> AttributeColumns:
        """``table``'s values as :meth:`value` reads them, column by column (the same names and
        ``others``): a column of numbers and missing values is kept as it is unless it holds a
        zero, a column of remembered strings costs one dictionary look-up per value."""
        values = []
        for name, column in zip(table.names, table.values):
            memo = self._memo.get(name)
            if memo is not None:
                try:
                    read: list = list(map(memo.get, column))  # strings only are remembered: others miss
                except TypeError:  # an unhashable value: every value read below
                    read = [None] * len(column)
                if None in read:
                    spec = self._categorical[name]
                    for i in [i for i, found in enumerate(read) if found is None]:
                        value = column[i]
                        if type(value) is str:
                            read[i] = self._category(memo, spec, value)
                        elif value is not None:
                            read[i] = self.value(name, value)
            elif name in self._numeric and not _NUMBER_TYPES.issuperset(map(type, column)):
                read = [self.value(name, value) for value in column]
            elif 0.0 in column:  # 0.0 == -0.0: a zero of either sign is written 0.0
                read = [value + 0.0 if type(value) is float else value for value in column]
            else:
                read = column
            values.append(read)
        return AttributeColumns(table.names, values, table.others)

    @staticmethod
    def _category(memo: dict[str, str], spec: tuple, value: str) -> str:
        """A string of a categorical feature as the schema reads it ("" for missing), remembered."""
        found = memo.get(value)
        if found is None:
            found = to_category(value, *spec) or ""  # a string is always read as a category
            if len(memo) < _MEMO_LIMIT:
                memo[value] = found
        return found


def request_fingerprint(
    model_name: str, entity_id: str, attributes: Mapping[str, Any], reading: SchemaReading | None = None
) -> str:
    """SHA-256 (64 hex characters) of the canonical request.

    Args:
        model_name: the model family that decides (the resolved name, never "" for the default).
        entity_id: the business id of the entity.
        attributes: raw attribute values (float, str, bool or None).
        reading: the family's :class:`SchemaReading`: the values are fingerprinted as the schema
            reads them (what PredictionService does); None: as given.

    The canonical form is the JSON array ``[model_name, entity_id, [[name, value], …]]`` with
    attributes sorted by name and missing values left out; JSON keeps ``1.0``, ``"1"`` and
    ``true`` apart, so values the schema reads apart stay apart.
    """
    if reading is not None:
        attributes = reading.record(attributes)
    # _missing() inlined: a call per attribute cost more than the rest of the fingerprint
    present = sorted(
        [
            (name, value)
            for name, value in attributes.items()
            if value is not None and value != "" and not (isinstance(value, float) and value != value)
        ]
    )
    return hashlib.sha256(_CANONICAL.encode([model_name, entity_id, present]).encode()).hexdigest()


def request_fingerprints(
    model_name: str,
    entity_ids: Sequence[str],
    records: Sequence[Mapping[str, Any]],
    columns: AttributeColumns | None = None,
    reading: SchemaReading | None = None,
) -> list[str]:
    """:func:`request_fingerprint` of many requests of one family, the same hex digests.

    Args:
        columns: ``records``' values column by column, names sorted
            (:meth:`~mlpair.contracts.columns.ColumnAssembler.columns`), when the caller has read
            them; else the names of the first record are read.
        reading: the family's :class:`SchemaReading` (:meth:`SchemaReading.columns` reads the
            columns, :meth:`SchemaReading.record` a row fingerprinted by itself); None: as given.

    The canonical JSON of every row holding no attribute outside the columns' names is written
    column by column (a row lacking one of them is written as the canonical form writes a
    missing value: left out) from per-value fragments: each attribute's ``["name",value]`` text
    made once per distinct string or flag and by ``float.__repr__`` (what the JSON encoder
    writes) for finite numbers. A missing value (None, "" or NaN) leaves its fragment out, as the
    canonical form does. A row with another attribute, a non-finite number or a value of another
    type, is fingerprinted by :func:`request_fingerprint` itself.
    """
    if len(records) < 8:  # a few rows: building the fragments would cost more than it saves
        return [request_fingerprint(model_name, e, r, reading) for e, r in zip(entity_ids, records)]
    if columns is None:
        columns = attribute_columns(records, sorted(records[0].keys()))
    if reading is not None:
        columns = reading.columns(columns)
    names, others = columns.names, columns.others
    other = set(others)
    alike = [k for k in range(len(records)) if k not in other] if others else range(len(records))
    values = [[column[k] for k in alike] for column in columns.values] if others else columns.values
    out = [""] * len(records)
    made = reading.fragments if reading is not None else _Fragments
    fragments = [made(name).column(column) for name, column in zip(names, values)]
    alone: set[int] = set()  # rows with a value fingerprinted by itself (an infinity, a value of another type)
    for column in fragments:
        if None in column:
            alone.update(k for k, fragment in enumerate(column) if fragment is None)
    head = _CANONICAL.encode(model_name)
    ids = [entity_ids[k] for k in alike] if others else list(entity_ids)
    if alone:
        fragments = [[f or "" for f in column] if None in column else column for column in fragments]
    bodies = map("".join, zip(*fragments)) if fragments else itertools.repeat("", len(alike))
    if _ESCAPED.search("".join(ids)) is None:  # the JSON encoder writes each id as it is, quoted
        texts = [f'[{head},"{e}",[{b[:-1]}]]' for e, b in zip(ids, bodies)]
    else:
        encode = _CANONICAL.encode
        texts = [f"[{head},{encode(e)},[{b[:-1]}]]" for e, b in zip(ids, bodies)]
    sha256 = hashlib.sha256
    for k, text in zip(alike, texts):
        out[k] = sha256(text.encode()).hexdigest()
    for j in alone:
        out[alike[j]] = request_fingerprint(model_name, entity_ids[alike[j]], records[alike[j]], reading)
    for k in others:
        out[k] = request_fingerprint(model_name, entity_ids[k], records[k], reading)
    return out


class _Fragments:
    """The canonical JSON fragments ``["name",value],`` of one attribute's values, each with the
    comma that follows it in the attribute list (a row's list is its fragments joined, less the
    last comma; a missing value's fragment is empty).

    Each distinct value's fragment is made once and remembered (up to :data:`_FRAGMENT_LIMIT`),
    keyed by (value, type): ``True`` and ``1.0`` are equal keys alone. A column is looked up in one
    pass of C (``map``) and only the values not remembered are visited in Python. A zero is never
    remembered (``-0.0 == 0.0`` but their texts differ), nor a NaN (missing) or an infinity (its row
    is fingerprinted by itself).
    """

    __slots__ = ("_head", "_memo")

    def __init__(self, name: str) -> None:
        self._head = f"[{_CANONICAL.encode(name)},"
        self._memo: dict[tuple[Any, type], str] = {(None, type(None)): "", ("", str): ""}

    def column(self, values: list) -> list[str | None]:
        """Each value's fragment: "" for a missing value, None for one fingerprinted row by row."""
        memo = self._memo
        try:
            out: list[str | None] = list(map(memo.get, zip(values, map(type, values))))
        except TypeError:  # an unhashable value (its row is fingerprinted by itself): every value visited
            out = [None] * len(values)
        if None not in out:
            return out
        head = self._head
        for k in [k for k, found in enumerate(out) if found is None]:
            value = values[k]
            kind = type(value)
            if kind is float:
                if value - value != 0.0:  # NaN is missing; an infinity is fingerprinted row by row
                    out[k] = "" if value != value else None
                    continue
                found = f"{head}{value!r}],"  # float.__repr__: what the JSON encoder writes
                if value == 0.0:
                    out[k] = found
                    continue
            elif kind is str or kind is bool:
                found = f"{head}{_CANONICAL.encode(value)}],"
            else:
                continue  # another type: the row is fingerprinted by itself
            if len(memo) < _FRAGMENT_LIMIT:
                memo[value, kind] = found
            out[k] = found
        return out
