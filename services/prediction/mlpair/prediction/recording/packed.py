"""Columns packed into one text value each: how batches of decisions travel to and from PostgreSQL.

Sending a column as an array parameter makes asyncpg check every element against Python's
abstract collection types (``isinstance(x, Iterable)``, a Python-level call per element): with
15 columns that was most of the client CPU of a ledger commit and of a relay delivery
(docs/decisions/0010-packed-ledger-columns-not-binary-copy.md). A packed column is one string
instead — each value's text, every one preceded by the ASCII unit separator (``\\x1f``) — that
PostgreSQL splits back with ``string_to_array`` (:func:`unpacked`); a relay's claim comes back
packed the same way, made by ``string_agg`` (:func:`packed_agg`), so a batch crosses the relay
without one Python object per value.

The separator is never part of a value: ids refuse control characters
(:func:`~mlpair.prediction.intake.checks.check_id`), labels, codes and versions are identifiers, JSON
escapes control characters, and numbers and timestamps are digits. :func:`pack` checks anyway
and refuses a value that holds it (the caller then uses arrays).

Every conversion is exact: a float travels as ``repr`` (the shortest text that reads back as the
same double; PostgreSQL ≥ 12 reads and writes float8 the same way), a timestamp as ISO 8601 with
microseconds and offset, NULL as the empty text of a nullable number column.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

SEP = "\x1f"


class Unpackable(ValueError):
    """A value holds the separator; send the batch as arrays instead."""


def pack(values: list[str]) -> str:
    """One packed column: ``SEP + SEP.join(values)`` (the leading separator keeps an empty batch
    and a batch of one empty string apart).

    Raises:
        Unpackable: a value holds the separator.
    """
    text = SEP + SEP.join(values)
    if text.count(SEP) != len(values):
        raise Unpackable("a value holds the unit separator")
    return text


def pack_column(values: list, order: Sequence[int], sql_type: str) -> str:
    """The values at positions ``order`` of one column (``sql_type``: text, float8, int4 or
    timestamptz) written as text (:func:`floats`, ``str`` for int4, :func:`timestamps`) and
    packed (:func:`pack`).

    Raises:
        Unpackable: a value holds the separator.
    """
    if sql_type == "timestamptz":  # a call's decisions share one timestamp: formatted once
        values, sql_type = timestamps(values), "text"
    taken = [values[i] for i in order]
    if sql_type == "float8":
        taken = floats(taken)
    elif sql_type == "int4":
        taken = list(map(str, taken))
    return pack(taken)


def floats(values: list[float | None]) -> list[str]:
    """Nullable float8 values as text (None → empty)."""
    return ["" if v is None else repr(float(v)) for v in values]


def timestamps(values: list[datetime]) -> list[str]:
    """Timezone-aware timestamps as ISO 8601 text; each distinct one is formatted once (a call's
    decisions share theirs)."""
    if values and values.count(values[0]) == len(values):  # one datetime throughout (a call's decisions)
        return [values[0].isoformat()] * len(values)
    memo: dict[datetime, str] = {}
    out = []
    for v in values:
        text = memo.get(v)
        if text is None:
            text = memo[v] = v.isoformat()
        out.append(text)
    return out


def unpacked(k: int) -> str:
    """SQL for parameter ``$k`` (a packed column) as a ``text[]`` of its values."""
    return f"(string_to_array(${k}::text, E'\\x1f'))[2:]"


def packed_agg(expression: str) -> str:
    """SQL aggregating a text ``expression`` over rows into one packed column, in the order the rows
    reach the aggregate.

    Every ``packed_agg`` of one ``SELECT`` reads the same rows in the same order (one aggregate node
    feeds each row to all its aggregates in turn), so the k-th value of each packed column belongs
    to the same row whatever that order is; the query sorts its rows once, below the aggregates,
    for the order itself. An ``ORDER BY`` inside each aggregate would sort its input once per
    column: PostgreSQL 15 does, and a relay's claim of 14 columns cost PostgreSQL more CPU per
    decision than with the one sort (docs/decisions/0008-one-outbox-row-per-commit.md)."""
    return f"E'\\x1f' || coalesce(string_agg({expression}, E'\\x1f'), '')"


def cast(column: str, sql_type: str) -> str:
    """SQL turning an unpacked text ``column`` back into ``sql_type`` (empty text is NULL for numbers)."""
    if sql_type == "text":
        return column
    if sql_type in ("float8", "int4"):
        return f"NULLIF({column}, '')::{sql_type}"
    return f"{column}::{sql_type}"


def as_text(column: str, sql_type: str) -> str:
    """SQL giving a column's value as the text :func:`cast` reads back (NULL → empty)."""
    if sql_type == "text":
        return column
    if sql_type == "timestamptz":  # ISO 8601, microseconds and offset, whatever the session's DateStyle
        return f"to_char({column} AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"+00:00\"')"
    return f"coalesce({column}::text, '')"
