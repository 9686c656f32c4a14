"""C51: the idempotency fingerprint is taken over the values as the feature schema reads them.

Every spelling the schema's conversion rules turn into one value gives one fingerprint, row by row
and column by column; values the rules read apart give different fingerprints. The real schemas of
both families (``config/*/feature-schema.toml``). Fingerprints are kept in the shared decision
ledger, so their values are pinned too: a change would make every retry of a recorded request a
conflict.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from mlpair.contracts.schema import FeatureSchema
from mlpair.prediction.preparing.idempotency import SchemaReading, request_fingerprint, request_fingerprints
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


# ---- a batch's fingerprints are each row's own; pinned values ----

awkward_texts = st.one_of(
    st.text(max_size=12), st.sampled_from(['"', "\\", "\x00", "\x1f", "\x7f", "\u2028", 'é"\\n', "\b\f\n\r\t", "😀"])
)
awkward_values = st.one_of(
    st.none(), st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e300, 5e-324]),
    awkward_texts, st.booleans(), st.integers(-5, 5),
)


@settings(max_examples=300, deadline=None)
@given(
    records=st.lists(awkward_texts, min_size=1, max_size=4, unique=True).flatmap(
        lambda names: st.lists(st.fixed_dictionaries({n: awkward_values for n in names}), min_size=8, max_size=12)
    ),
    entity_ids=st.lists(awkward_texts, min_size=12, max_size=12),
    model_name=awkward_texts,
)
def test_fingerprints_of_a_batch_are_each_rows_own(records, entity_ids, model_name) -> None:
    """Escapes, non-ASCII, missing values of every spelling, infinities and ints (fingerprinted
    row by row) give each row's own fingerprint through the batch's fragments."""
    entity_ids = entity_ids[: len(records)]
    expected = [request_fingerprint(model_name, e, r) for e, r in zip(entity_ids, records)]
    assert request_fingerprints(model_name, entity_ids, records) == expected


@settings(max_examples=200, deadline=None)
@given(
    records=st.lists(
        st.dictionaries(st.sampled_from(["a", "b", "c", "é", "z"]), awkward_values, max_size=5), min_size=8, max_size=12
    ),
    read=st.sets(st.sampled_from(["a", "b", "c", "é", "z"])),
)
def test_fingerprints_of_rows_with_different_attributes_are_each_rows_own(records, read) -> None:
    """Rows lacking some attributes or holding others, fingerprinted from columns the caller read
    (names sorted: a missing name written as missing, a row with another name row by row) or
    from the first row's names: each row's own."""
    from mlpair.contracts.columns import attribute_columns

    entity_ids = [f"e{k}" for k in range(len(records))]
    expected = [request_fingerprint("m", e, r) for e, r in zip(entity_ids, records)]
    assert request_fingerprints("m", entity_ids, records, attribute_columns(records, sorted(read))) == expected
    assert request_fingerprints("m", entity_ids, records) == expected


def test_floats_of_every_form_are_fingerprinted_as_the_json_encoder_writes_them() -> None:
    """Whole numbers, short decimals at every scale, random bit patterns and the shortest-repr
    edge cases: a batch's fragments (``float.__repr__``) give the canonical JSON's fingerprints."""
    from tests.support.ledger import float_sweep

    values = float_sweep(3, 3000)
    for start in range(0, len(values), 500):
        rows = [{"a": v} for v in values[start : start + 500]]
        entity_ids = ["e"] * len(rows)
        assert request_fingerprints("m", entity_ids, rows) == [request_fingerprint("m", "e", r) for r in rows]


# Computed before the batch path lost its compiled texts and digests, and by it then: the same.
PINNED_ROWS = [
    {"Age": 30.0 + i, "Home": "rent" if i % 2 else "owner", "Records": i % 3 == 0, "Income": None if i == 4 else 129.5,
     "Job": 'frei\u00dfchaffend "x"' if i == 5 else "fixed", "Amount": math.nan if i == 6 else 800.0 + i}
    for i in range(10)
]
PINNED = {
    0: "725fa383d10917afaee7ab576cc028d4a4c6a2f11f2409b67d8779a6e725c847",
    4: "72ef468465c168000c848621597080bac350a4c64dbc04780e0dbe6bcc8864b8",  # a missing value
    5: "cc296f38273e5a38bdcf65511f71a8ba895929803d688ca56c955383ecb3109a",  # escapes, non-ASCII
    6: "635edfa50d366d00b8ddbf02a86f0418988f5d53f48f7f4fac303a66678e3ed6",  # NaN: missing
    9: "17ff2d2e6875a627e5078cd64ed29bceae7c3bf0ccb1cfa2e4445d829ccf694c",
}


def test_fingerprint_values_are_the_ones_ledgers_hold() -> None:
    entity_ids = [f"applicant-{i}" for i in range(len(PINNED_ROWS))]
    many = request_fingerprints("credit-risk", entity_ids, PINNED_ROWS)
    assert {k: many[k] for k in PINNED} == PINNED
    assert {k: request_fingerprint("credit-risk", entity_ids[k], PINNED_ROWS[k]) for k in PINNED} == PINNED
