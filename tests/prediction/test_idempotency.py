"""C51: the idempotency fingerprint is taken over the values as the feature schema reads them.

Every spelling the schema's conversion rules turn into one value gives one fingerprint, row by row
and column by column (the C texts and the Python fragments); values the rules read apart give
different fingerprints. The real schemas of both families (``config/*/feature-schema.toml``).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlpair.contracts.schema import FeatureSchema
from mlpair.prediction import idempotency
from mlpair.prediction.idempotency import SchemaReading, request_fingerprint, request_fingerprints
from tests.support import CHURN_SCHEMA, CREDIT_SCHEMA

SCHEMAS = {"credit-risk": FeatureSchema.from_toml(CREDIT_SCHEMA), "churn": FeatureSchema.from_toml(CHURN_SCHEMA)}
READINGS = {name: SchemaReading(schema) for name, schema in SCHEMAS.items()}
_TRUE, _FALSE = [True, 1.0, "yes", " Y ", "TRUE", "1"], [False, 0.0, -0.0, "no", "n", " false ", "0"]
MISSING = [None, math.nan, "", "   "]


def spellings(feature, value) -> list:
    """Every spelling of ``value`` (as the schema reads it) that ``feature``'s rules accept."""
    if value is None:
        return MISSING
    if getattr(feature, "type", None) == "boolean":
        return _TRUE if value else _FALSE
    if hasattr(feature, "strings"):  # numeric
        out = [value, repr(value), f" {value!r}\t"] + ([f"{value!r}e0"] if "e" not in repr(value) else [])
        if value == 0.0:
            out += [-0.0, "-0", "-0.0", "0e5"]
        if value.is_integer():
            out += [str(int(value)), f"{int(value):+d}", f"{int(value)}.000"]
        return out
    out = [value, value.upper(), f"  {value.title()}\t"]  # trim_lower
    if feature.booleans == "yes_no" and value in ("yes", "no"):
        out.append(value == "yes")
    return out


def value_of(feature):
    """A value the schema reads (None: missing)."""
    if getattr(feature, "type", None) == "boolean":
        return st.sampled_from([True, False, None])
    if hasattr(feature, "strings"):
        whole = feature.type == "integer"
        numbers = st.integers(-5, 200).map(float) if whole else st.sampled_from([0.0, 1.5, 42.0, 1e300, -3.25, 5e-324])
        return st.one_of(st.none(), numbers, st.sampled_from(feature.sentinels or [0.0]))
    return st.sampled_from([None, "yes", "no", "owner", "rent", "month-to-month", "fiber optic"])


@st.composite
def spelt_rows(draw, family: str):
    """(the values as read, 8–12 rows each spelling them its own way)."""
    schema = SCHEMAS[family]
    read = {f.name: draw(value_of(f)) for f in schema.features}
    rows = []
    for _ in range(draw(st.integers(8, 12))):
        row = {}
        for f in schema.features:
            choice = draw(st.sampled_from(spellings(f, read[f.name]) + (["absent"] if read[f.name] is None else [])))
            if choice != "absent":
                row[f.name] = choice
        rows.append(row)
    return read, rows


@settings(max_examples=60, deadline=None)
@given(data=st.data(), family=st.sampled_from(sorted(SCHEMAS)))
def test_c51_every_spelling_of_one_value_has_one_fingerprint_row_by_row_and_by_columns(data, family) -> None:
    _, rows = data.draw(spelt_rows(family))
    reading = READINGS[family]
    entity_ids = ["entity-1"] * len(rows)
    [one] = {request_fingerprint(family, "entity-1", row, reading) for row in rows}
    assert request_fingerprints(family, entity_ids, rows, reading=reading) == [one] * len(rows)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(idempotency, "_canonical_texts", None)
        assert request_fingerprints(family, entity_ids, rows, reading=reading) == [one] * len(rows)


def test_c51_values_the_schema_reads_apart_have_different_fingerprints() -> None:
    """Each pair is two values to the schema: other numbers, another category or flag, a sentinel
    and an absent value (other reason codes), a number and a refused spelling of it."""
    base = {"credit-risk": {"Age": 30.0, "Debt": 0.0, "Income": 120.0, "Home": "owner"},
            "churn": {"tenure": 12.0, "senior_citizen": True, "online_security": "yes", "contract": "one year"}}
    pairs = [
        ("credit-risk", "Age", 30.0, "31"), ("credit-risk", "Age", 30.0, 30.000000000000004),
        ("credit-risk", "Debt", 0.0, 5e-324), ("credit-risk", "Debt", 0.0, None),
        ("credit-risk", "Income", 99999999.0, None), ("credit-risk", "Income", 99999999.0, 5000.0),
        ("credit-risk", "Home", "owner", "rent"), ("credit-risk", "Home", "owner", "owner2"),
        ("credit-risk", "Age", 30.0, "30 years"),  # refused by the schema: never the number
        ("churn", "tenure", 12.0, "13"), ("churn", "senior_citizen", True, False),
        ("churn", "senior_citizen", True, None), ("churn", "online_security", "yes", False),
        ("churn", "contract", "one year", "two year"),
    ]
    differ = 0
    for family, name, first, second in pairs:
        reading, rows = READINGS[family], []
        for value in (first, second):
            row = {k: v for k, v in base[family].items() if k != name}
            if value is not None:
                row[name] = value
            rows.append(row)
        a, b = (request_fingerprint(family, "entity-1", row, reading) for row in rows)
        many = request_fingerprints(family, ["entity-1"] * 8, [rows[0]] * 4 + [rows[1]] * 4, reading=reading)
        assert a != b and many == [a] * 4 + [b] * 4, (family, name, first, second)
        differ += 1
    assert differ == len(pairs) == 14


def test_c51_an_attribute_the_schema_does_not_read_keeps_its_type_and_a_zero_its_value() -> None:
    reading = READINGS["credit-risk"]
    fingerprints = [request_fingerprint("credit-risk", "e", {"Age": 30.0, "Note": value}, reading)
                    for value in (0.0, -0.0, "0", False, "x", " X ")]
    assert len(set(fingerprints)) == 5 and fingerprints[0] == fingerprints[1]
