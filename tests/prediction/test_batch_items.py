"""The compiled BatchPredict reader and writer (``mlpair/_batch_items.c``) give what protobuf gives.

The writer (``write_rows``) is checked at the end: rows written column by column parse as the
messages built field by field (and, on real outcomes of every kind, in
``tests/e2e/test_batch_predict.py``).

``converters.batch_inputs`` reads a BatchPredict's items from the request's wire bytes where
``mlpair._batch_items`` is built, and through the parsed message (``parsed_input``) where it is
not; ``converters.predict_input`` reads a Predict call the same way, as a batch of one. Both must hand the pipeline the same items: the same ids, model names, explain flags and
attribute values, of the same types (``1.0``, ``"1"`` and ``True`` stay apart; ``-0.0``, NaN and
a value with no kind set stay what they are). Checked on generated requests, and on wire bytes a
protobuf parser reads by rules a re-serialised message never exercises (a key given twice, a value
merged from two parts); bytes it cannot read, and fields it does not know, leave the decision to
the parsed message. Damaged bytes (a fuzz test) never crash it.
"""

from __future__ import annotations

import os
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.prediction import converters

try:
    from mlpair._batch_items import read_items
except ImportError:  # not built here: only the fallback runs
    read_items = None

needs_reader = pytest.mark.skipif(read_items is None, reason="mlpair._batch_items is not built (setup.py)")


def comparable(value):
    """A value as type and repr, so -0.0 differs from 0.0 and NaN equals NaN."""
    return type(value).__name__, repr(value)


def as_seen(items) -> list:
    return [
        (i.request_id, i.entity_id, i.model_name, i.explain, i.deadline, {k: comparable(v) for k, v in i.attributes.items()})
        for i in items
    ]


def parsed(request: pb.BatchPredictRequest, deadline: float | None = None) -> list:
    """The items as the parsed message gives them (the fallback path)."""
    return as_seen([converters.parsed_input(item, deadline) for item in request.requests])


def test_the_compiled_reader_is_built_where_ci_runs() -> None:
    """A missing C compiler makes the install fall back silently (setup.py: optional); CI has
    one, so there the reader must be there and in use."""
    if os.environ.get("CI") != "true" and read_items is None:
        pytest.skip("mlpair._batch_items is not built here (no C compiler?); CI requires it")
    assert read_items is not None
    assert converters._read_items is read_items


texts = st.text(max_size=12)
values = st.one_of(
    st.none(),
    st.builds(lambda x: pb.AttributeValue(number_value=x), st.floats(allow_nan=True, allow_infinity=True)),
    st.builds(lambda x: pb.AttributeValue(string_value=x), texts),
    st.builds(lambda x: pb.AttributeValue(bool_value=x), st.booleans()),
    st.just(pb.AttributeValue()),  # present, no kind set: None
)


@st.composite
def batch_requests(draw) -> pb.BatchPredictRequest:
    request = pb.BatchPredictRequest()
    for _ in range(draw(st.integers(0, 6))):
        item = request.requests.add(
            request_id=draw(texts), entity_id=draw(texts), model_name=draw(st.sampled_from(["", "credit-risk", "é"])),
            explain=draw(st.booleans()),
        )
        for name, value in draw(st.dictionaries(texts, values, max_size=8)).items():
            if value is None:
                continue
            item.attributes[name].CopyFrom(value)
    return request


@needs_reader
@settings(max_examples=400, deadline=None)
@given(batch_requests(), st.one_of(st.none(), st.floats(0, 1e6)))
def test_generated_requests_read_the_same_both_ways(request: pb.BatchPredictRequest, deadline) -> None:
    assert as_seen(converters.batch_inputs(request, deadline)) == parsed(request, deadline)


@needs_reader
@settings(max_examples=300, deadline=None)
@given(batch_requests(), st.one_of(st.none(), st.floats(0, 1e6)))
def test_generated_predict_calls_read_the_same_both_ways(request: pb.BatchPredictRequest, deadline) -> None:
    assert as_seen([converters.predict_input(item, deadline) for item in request.requests]) == parsed(request, deadline)


@needs_reader
def test_a_predict_call_with_a_field_the_reader_does_not_know_is_read_through_the_message() -> None:
    known = pb.PredictRequest(request_id="r", entity_id="e", attributes={"Age": pb.AttributeValue(number_value=30.0)})
    newer = pb.PredictRequest.FromString(known.SerializeToString() + varint(99 << 3 | 0) + varint(1))  # a newer client's field
    assert read_items(delimited(1, newer.SerializeToString())) is None  # the reader leaves it to the parser
    assert as_seen([converters.predict_input(newer, 2.0)]) == as_seen([converters.parsed_input(known, 2.0)])


@needs_reader
def test_holdout_applicants_read_the_same_both_ways(credit_holdout) -> None:
    from mlpair.client import to_attributes

    records = credit_holdout.records
    request = pb.BatchPredictRequest(
        requests=[
            pb.PredictRequest(request_id=f"r-{i}", entity_id=f"e-{i}", model_name="credit-risk", attributes=to_attributes(r))
            for i, r in enumerate(records)
        ]
    )
    assert as_seen(converters.batch_inputs(request)) == parsed(request)


# Hand-made wire bytes: tag = field number << 3 | wire type (https://protobuf.dev/programming-guides/encoding/).
def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def delimited(field: int, payload: bytes) -> bytes:
    return varint(field << 3 | 2) + varint(len(payload)) + payload


def entry(key: bytes, *value_parts: bytes) -> bytes:
    return delimited(3, delimited(1, key) + b"".join(delimited(2, part) for part in value_parts))


NUMBER = varint(1 << 3 | 1) + struct.pack("<d", 2.5)
TEXT = delimited(2, b"rent")
FLAG = varint(3 << 3 | 0) + varint(1)
UNUSED = varint(9 << 3 | 0) + varint(7) + varint(10 << 3 | 5) + b"\x00\x00\x00\x00" + varint(11 << 3 | 1) + bytes(8)


@needs_reader
@pytest.mark.parametrize(
    "item",
    [
        pytest.param(entry(b"a", NUMBER) + entry(b"a", TEXT), id="a key given twice keeps the last entry"),
        pytest.param(entry(b"a", NUMBER, TEXT), id="a value given in two parts is merged, the later member wins"),
        pytest.param(entry(b"a", TEXT, b""), id="an empty later part keeps the member set before"),
        pytest.param(entry(b"a", NUMBER + FLAG), id="two members in one part: the later wins"),
        pytest.param(entry(b"", FLAG) + delimited(3, delimited(2, NUMBER)), id="an empty or missing key is the empty name"),
        pytest.param(delimited(1, b"x") + delimited(1, b"y") + varint(5 << 3) + varint(1) + varint(5 << 3) + varint(0), id="a scalar given twice keeps the last"),
    ],
)
def test_wire_rules_are_the_parsers(item: bytes) -> None:
    data = delimited(1, item) * 2
    request = pb.BatchPredictRequest.FromString(data)
    assert as_seen(PredictInputs(read_items(data))) == parsed(request)


def PredictInputs(items) -> list:
    return [converters.PredictInput(rid, eid, attributes, model, explain) for rid, eid, model, attributes, explain in items]


@needs_reader
@pytest.mark.parametrize(
    "data",
    [
        pytest.param(delimited(1, entry(b"a", NUMBER))[:-3], id="truncated"),
        pytest.param(delimited(1, entry(b"\xff\xfe", NUMBER)), id="a key that is not UTF-8"),
        pytest.param(delimited(1, entry(b"a", delimited(2, b"\xc3"))), id="a string value that is not UTF-8"),
        pytest.param(delimited(1, varint(6 << 3 | 3) + varint(6 << 3 | 4)), id="a group"),
        pytest.param(delimited(1, varint(3 << 3 | 2) + varint(200)), id="a length past the end"),
        # fields it does not know, at every depth: a parser's rules for them are subtler (a map
        # entry holding one stays out of the map), and the service refuses them before this runs
        pytest.param(delimited(1, UNUSED + entry(b"a", TEXT)), id="an unknown field in an item"),
        pytest.param(delimited(1, entry(b"a", UNUSED + TEXT)), id="an unknown field in a value"),
        pytest.param(delimited(1, delimited(3, delimited(1, b"a") + UNUSED)), id="an unknown field in a map entry"),
        pytest.param(delimited(1, varint(3 << 3 | 0) + varint(5)), id="a known number with another wire type"),
        pytest.param(delimited(1, entry(b"a", varint(1 << 3 | 0) + varint(4))), id="a value member with another wire type"),
        pytest.param(UNUSED + delimited(1, entry(b"a", TEXT)), id="an unknown field in the request"),
        pytest.param(delimited(1, b"\x80" * 10 + b"\x01"), id="a varint of eleven bytes"),
        pytest.param(delimited(1, varint(0 << 3 | 2) + varint(0)), id="field number 0"),
        pytest.param(delimited(1, varint(1 << 3 | 7)), id="wire type 7"),
    ],
)
def test_bytes_it_cannot_read_are_left_to_the_parser(data: bytes) -> None:
    assert read_items(data) is None


@needs_reader
@settings(max_examples=500, deadline=None)
@given(batch_requests(), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4), st.integers(0, 64))
def test_damaged_bytes_read_as_the_parser_reads_them_or_not_at_all(request, flips, cut) -> None:
    """Any bytes — a valid request with bytes changed and its end cut — never crash the reader;
    where the protobuf parser accepts them, the reader gives what the parser gives, or None; where
    the parser refuses them, the reader does too (a served BatchPredict is read by it first)."""
    data = bytearray(request.SerializeToString())
    for at, value in flips:
        if data:
            data[at % len(data)] = value
    data = bytes(data[: max(0, len(data) - cut)])
    read = read_items(data)
    try:
        parsed_request = pb.BatchPredictRequest.FromString(data)
    except Exception:  # noqa: BLE001  (not a message: refused by the reader too)
        assert read is None
        return
    if read is not None:
        assert as_seen(PredictInputs(read)) == parsed(parsed_request)


def test_without_the_reader_the_parsed_message_is_read(monkeypatch) -> None:
    request = pb.BatchPredictRequest(
        requests=[pb.PredictRequest(request_id="r", entity_id="e", attributes={"a": pb.AttributeValue(number_value=1.0)})]
    )
    monkeypatch.setattr(converters, "_read_items", None)
    assert as_seen(converters.batch_inputs(request, 5.0)) == parsed(request, 5.0)


# ---- writing: write_rows against messages built field by field ----

try:
    from mlpair._batch_items import write_rows
except ImportError:
    write_rows = None

needs_writer = pytest.mark.skipif(write_rows is None, reason="mlpair._batch_items is not built (setup.py)")
KINDS = {"string": 0, "double": 1, "bool": 2, "int": 3, "strings": 4, "timestamp": 5}
# PredictResponse fields of every kind write_rows writes (decided_at: a Timestamp)
FIELDS = [
    ("request_id", "string", st.one_of(st.none(), texts)),
    ("probability", "double", st.one_of(st.none(), st.floats(allow_nan=False), st.just(-0.0))),
    ("decision", "int", st.sampled_from([0, 1, 2, 3])),
    ("reason_codes", "strings", st.lists(texts, max_size=3)),
    ("from_cache", "bool", st.booleans()),
    ("cache_age_ms", "int", st.one_of(st.integers(-(2**31), 2**31 - 1))),
    ("decided_at", "timestamp", st.one_of(st.none(), st.tuples(st.integers(-62135596800, 253402300799), st.integers(0, 999_999_999)))),
]
NUMBERS = {name: f.number for name, f in pb.PredictResponse.DESCRIPTOR.fields_by_name.items()}


@needs_writer
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(*(strategy for _, _, strategy in FIELDS)), max_size=5))
def test_written_rows_parse_as_the_messages_built_field_by_field(rows) -> None:
    from google.protobuf import timestamp_pb2

    columns = [(NUMBERS[name], KINDS[kind], [row[k] for row in rows]) for k, (name, kind, _) in enumerate(FIELDS)]
    columns.sort(key=lambda c: c[0])
    written = pb.BatchPredictResponse.FromString(b"".join(write_rows(columns, len(rows), (1, 1))))
    expected = pb.BatchPredictResponse()
    for row in rows:
        fields = {name: value for (name, _, _), value in zip(FIELDS, row) if name != "decided_at"}
        prediction = expected.results.add().prediction
        prediction.MergeFrom(pb.PredictResponse(**fields))
        if row[-1] is not None:
            prediction.decided_at.CopyFrom(timestamp_pb2.Timestamp(seconds=row[-1][0], nanos=row[-1][1]))
    assert written == expected
    assert [r.prediction.ListFields() for r in written.results] == [r.prediction.ListFields() for r in expected.results]


@needs_writer
def test_a_value_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(TypeError):
        write_rows([(1, KINDS["string"], [3])], 1, (1,))
    with pytest.raises(TypeError):
        write_rows([(1, KINDS["strings"], ["not a list of codes"])], 1, (1,))
    with pytest.raises(ValueError):
        write_rows([(1, KINDS["string"], [])], 1, (1,))


# ---- the idempotency fingerprint's canonical texts ----

awkward_texts = st.one_of(texts, st.sampled_from(['"', "\\", "\x00", "\x1f", "\x7f", "\u2028", "é\"\\n", "\b\f\n\r\t", "😀"]))
attribute_values_ = st.one_of(
    st.none(), st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e300, 5e-324]),
    awkward_texts, st.booleans(), st.integers(-5, 5),
)


@settings(max_examples=300, deadline=None)
@given(
    records=st.lists(awkward_texts, min_size=1, max_size=4, unique=True).flatmap(
        lambda names: st.lists(st.fixed_dictionaries({n: attribute_values_ for n in names}), min_size=8, max_size=12)
    ),
    entity_ids=st.lists(awkward_texts, min_size=12, max_size=12),
    model_name=awkward_texts,
)
def test_fingerprints_of_a_batch_are_each_rows_own_both_ways(records, entity_ids, model_name) -> None:
    """Escapes, non-ASCII, missing values of every spelling, infinities and ints (the row-wise
    fallback) give each row's own fingerprint, through the C texts and through the fragments."""
    from mlpair.prediction import idempotency

    entity_ids = entity_ids[: len(records)]
    expected = [idempotency.request_fingerprint(model_name, e, r) for e, r in zip(entity_ids, records)]
    assert idempotency.request_fingerprints(model_name, entity_ids, records) == expected
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(idempotency, "_canonical_texts", None)
        assert idempotency.request_fingerprints(model_name, entity_ids, records) == expected


@settings(max_examples=200, deadline=None)
@given(
    records=st.lists(
        st.dictionaries(st.sampled_from(["a", "b", "c", "é", "z"]), attribute_values_, max_size=5),
        min_size=8,
        max_size=12,
    ),
    read=st.sets(st.sampled_from(["a", "b", "c", "é", "z"])),
)
def test_fingerprints_of_rows_with_different_attributes_are_each_rows_own_both_ways(records, read) -> None:
    """Rows lacking some attributes or holding others, fingerprinted from columns the caller read
    (names sorted: a missing name written as missing, a row with another name row by row) or
    from the first row's names, through the C texts and the fragments: each row's own."""
    from mlpair.prediction import idempotency
    from mlpair.prediction.columns import attribute_columns

    entity_ids = [f"e{k}" for k in range(len(records))]
    expected = [idempotency.request_fingerprint("m", e, r) for e, r in zip(entity_ids, records)]
    table = attribute_columns(records, sorted(read))
    assert idempotency.request_fingerprints("m", entity_ids, records, table) == expected
    assert idempotency.request_fingerprints("m", entity_ids, records) == expected
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(idempotency, "_canonical_texts", None)
        assert idempotency.request_fingerprints("m", entity_ids, records, table) == expected
        assert idempotency.request_fingerprints("m", entity_ids, records) == expected


# ---- a batch's attribute values column by column ----


@settings(max_examples=200, deadline=None)
@given(
    records=st.lists(st.dictionaries(awkward_texts, attribute_values_, max_size=5), max_size=12),
    names=st.lists(awkward_texts, max_size=6),
)
def test_attribute_columns_are_each_records_values_both_ways(records, names) -> None:
    """Records with names missing, extra or in any order: each column holds each record's value
    (None where it lacks the name), and the records holding a name that is not read are listed,
    through the compiled ``columns`` and the comprehension."""
    from mlpair.prediction import columns

    names = list(dict.fromkeys([*names, *(records[0] if records else ())]))
    expected = columns.AttributeColumns(
        names,
        [[r[name] if name in r else None for r in records] for name in names],
        [i for i, r in enumerate(records) if any(name not in names for name in r)],
    )
    assert columns.attribute_columns(records, names) == expected
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(columns, "_columns", None)
        assert columns.attribute_columns(records, names) == expected


def test_attribute_columns_of_records_that_are_not_dicts_are_read_as_mappings() -> None:
    """A record that is a mapping of another type (the parsed message's path) is read by the
    comprehension; the compiled part answers None for such a batch rather than guessing."""
    from types import MappingProxyType

    from mlpair.prediction.columns import _columns, attribute_columns

    records = [{"a": 1.0}, MappingProxyType({"a": 2.0, "b": "x"})]
    assert attribute_columns(records, ["a", "b"]).values == [[1.0, 2.0], [None, "x"]]
    assert attribute_columns(records, ["a"]).others == [1]
    if _columns is not None:
        assert _columns(records, ["a", "b"]) is None
        with pytest.raises(TypeError):
            _columns([{"a": 1.0}], [["unhashable"]])


@needs_reader
def test_a_served_batch_is_read_from_its_bytes_and_anything_else_goes_to_the_strict_parser() -> None:
    """As PredictionService registers BatchPredict: readable bytes reach the handler as the items
    read (no message parsed), bytes with fields the contract does not define as the refusal the
    strict parser makes (UNKNOWN_FIELD), bytes that are no message as the malformed marker."""
    from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
    from mlpair.rpc.servicers import _UNDECODABLE, _Captured, add_servicer
    from mlpair.wire import Refused

    server = _Captured()
    add_servicer(pb_grpc.add_PredictionServiceServicer_to_server, pb_grpc.PredictionServiceServicer(), server,
                 readers={"BatchPredict": converters.read_batch_request})
    read = server.handlers["BatchPredict"].request_deserializer
    request = pb.BatchPredictRequest(requests=[pb.PredictRequest(
        request_id="r", entity_id="e", attributes={"a": pb.AttributeValue(number_value=1.0)})])
    data = request.SerializeToString()
    got = read(data)
    assert isinstance(got, converters.ReadBatch)
    assert as_seen(converters.batch_inputs(got)) == parsed(request)
    assert isinstance(read(UNUSED + data), Refused)
    assert read(data[:-3]) is _UNDECODABLE
    assert isinstance(server.handlers["Predict"].request_deserializer(pb.PredictRequest().SerializeToString()),
                      pb.PredictRequest)  # only the method given a reader has one


# ---- the ledger's packed columns ----

packable = {
    "text": st.lists(awkward_texts, max_size=12),
    "float8": st.lists(st.one_of(st.none(), st.floats(), st.integers(-(2**60), 2**60)), max_size=12),
    "int4": st.lists(st.integers(-(2**31), 2**31 - 1), max_size=12),
}


@settings(max_examples=300, deadline=None)
@given(data=st.data(), sql_type=st.sampled_from(sorted(packable)))
def test_a_packed_column_is_the_same_text_both_ways(data, sql_type) -> None:
    """The values at any positions (repeated, out of order, none) of a text, float8 (None and
    ints among floats, NaN, infinities, -0.0) or int4 column pack to the same text through the
    compiled ``pack_column`` and the comprehensions, and a text holding the separator is refused
    both ways; what is packed splits back into each value's own text."""
    from mlpair.prediction.crm import packed

    values = data.draw(packable[sql_type])
    order = data.draw(st.lists(st.integers(0, len(values) - 1), max_size=15)) if values else []
    expected = {
        "text": lambda v: v,
        "float8": lambda v: "" if v is None else repr(float(v)),
        "int4": str,
    }[sql_type]

    def both_ways():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(packed, "_pack_column", None)
            try:
                fallback = packed.pack_column(values, order, sql_type)
            except packed.Unpackable:
                fallback = packed.Unpackable
        try:
            compiled = packed.pack_column(values, order, sql_type)
        except packed.Unpackable:
            compiled = packed.Unpackable
        return compiled, fallback

    compiled, fallback = both_ways()
    assert compiled == fallback
    taken = [expected(values[i]) for i in order]
    if any(packed.SEP in t for t in taken) or not order:  # no value: refused, as its text would be one ""'s
        assert compiled is packed.Unpackable
    else:
        assert compiled.split(packed.SEP)[1:] == taken


def test_a_packed_column_refuses_what_the_comprehension_refuses() -> None:
    """A text column holding a number, a float8 value float() refuses and a position outside the
    column raise the same errors through the compiled part and the comprehensions."""
    from mlpair.prediction.crm import packed

    for compiled in (packed._pack_column, None):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(packed, "_pack_column", compiled)
            with pytest.raises(TypeError):
                packed.pack_column(["a", 1.0], [0, 1], "text")
            with pytest.raises(ValueError):
                packed.pack_column(["x"], [0], "float8")
            with pytest.raises(IndexError):
                packed.pack_column(["a"], [1], "text")


# ---- floats written as repr writes them ----


def float_sweep(seed: int, n: int) -> list[float]:
    """Floats of every form the compiled writers meet: whole numbers, short decimals at every
    scale, random doubles and bit patterns, and the neighbours of the shortcut's range edges."""
    import math
    import random

    r = random.Random(seed)
    edges = [1e-4, 1e15, 1e14, 0.1, 1.0, 0.3, 999999999999999.0, 123456789012345.0, 5e-324, 1.7976931348623157e308]
    makers = [
        lambda: float(r.randint(-(10**15), 10**15)),
        lambda: round(r.uniform(-1e6, 1e6), r.randrange(0, 8)),
        lambda: r.randint(1, 10 ** r.randint(1, 15)) / 10 ** r.randint(0, 19),
        lambda: float(f"{r.randint(1, 10**15 - 1)}e{r.randint(-22, 3)}"),
        lambda: r.random() * 10 ** r.randint(-6, 17),
        lambda: struct.unpack("<d", struct.pack("<Q", r.getrandbits(64)))[0],
        lambda: math.nextafter(r.choice(edges), r.choice([0.0, math.inf])) * r.choice([1, -1]),
        lambda: r.choice(edges) * r.choice([1, -1]),
    ]
    values = (r.choice(makers)() for _ in range(n))
    return [v for v in values if math.isfinite(v)] + [0.0, -0.0, 0.1 + 0.2, 1 / 3, 9.999999999999999e-05]


@pytest.mark.parametrize("seed", [1, 2])
def test_packed_floats_are_their_repr(seed) -> None:
    """The packed float8 column writes each value as ``repr`` does, whether the compiled part's
    shortcut for short decimals takes it or CPython's own formatting does."""
    from mlpair.prediction.crm import packed

    values = float_sweep(seed, 100_000)
    compiled = packed.pack_column(values, list(range(len(values))), "float8")
    assert compiled.split(packed.SEP)[1:] == [repr(v) for v in values]


@needs_reader
@pytest.mark.parametrize("seed", [3, 4])
def test_canonical_floats_are_their_repr(seed) -> None:
    """Each float in a canonical request text is the JSON encoder's, which is ``repr``."""
    import json

    from mlpair._batch_items import canonical_texts

    values = float_sweep(seed, 100_000)
    texts = canonical_texts(b'"m"', ["e"] * len(values), [b'["a",'], [values])
    assert texts == [
        b'["m","e",[' + (b'["a",' + json.dumps(v).encode() + b"]" if v == v else b"") + b"]]" for v in values
    ]


@settings(max_examples=500, deadline=None)
@given(st.integers(-(10**15), 10**15), st.integers(0, 20))
def test_any_short_decimal_is_written_as_repr_writes_it(digits, places) -> None:
    """Every decimal of at most 15 significant digits, at any place of its point."""
    from mlpair.prediction.crm import packed

    value = digits / 10**places
    assert packed.pack_column([value], [0], "float8") == packed.SEP + repr(value)
