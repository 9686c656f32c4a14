"""Proto ⇄ domain conversions: decision labels, explanations and per-item errors; requests read from
the messages protobuf parsed, and the served methods' deserializers (the strict parse)."""

from __future__ import annotations

import math

from google.rpc import code_pb2, error_details_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.prediction.deciding.explain import Contribution, Explanation
from mlpair.prediction.errors import InvalidRequest, UnknownModel
from mlpair.prediction.intake import converters
from mlpair.prediction.pipeline import PredictionResult, UnexpectedFailure
from mlpair.prediction.records import StoredDecision


def stored(decision: str) -> StoredDecision:
    return StoredDecision("d-1", "r-1", "e-1", "churn", "1", "churn/v1", "churn-policy/v1", 0.7, decision, ("HIGH_CHURN_RISK",))


def test_family_labels_travel_as_decision_label_and_fill_the_enum_only_when_it_names_them():
    churn = converters.predict_response(PredictionResult(stored("RETAIN_OFFER")))
    assert (churn.decision_label, churn.decision) == ("RETAIN_OFFER", pb.DECISION_UNSPECIFIED)
    credit = converters.predict_response(PredictionResult(stored("DECLINE")))
    assert (credit.decision_label, credit.decision) == ("DECLINE", pb.DECISION_DECLINE)


def test_explanations_and_extras_are_converted():
    explanation = Explanation((Contribution("tenure", -0.12, "TENURE_LOWERS_CHURN_RISK", "Time as a customer lowered..."),),
                              ("Time as a customer lowered...",))
    reply = converters.predict_response(PredictionResult(stored("NO_ACTION"), spread=0.05, calibration_method="platt",
                                                         explanation=explanation))
    assert reply.spread == 0.05 and reply.calibration_method == "platt"
    assert [(c.feature, c.contribution, c.reason_code) for c in reply.contributions] == \
        [("tenure", -0.12, "TENURE_LOWERS_CHURN_RISK")]
    assert list(reply.top_reasons) == ["Time as a customer lowered..."]


def test_item_errors_become_statuses_with_error_info_in_request_order():
    outcomes = [PredictionResult(stored("NO_ACTION")),
                InvalidRequest("attribute values cannot be converted: tenure", metadata={"attributes": "tenure"}),
                UnknownModel("model family 'x' is not served here"),
                UnexpectedFailure("internal error")]
    reply = converters.batch_response(outcomes)
    assert [r.WhichOneof("outcome") for r in reply.results] == ["prediction", "error", "error", "error"]
    codes = [r.error.code for r in reply.results[1:]]
    assert codes == [code_pb2.INVALID_ARGUMENT, code_pb2.NOT_FOUND, code_pb2.INTERNAL]
    info = error_details_pb2.ErrorInfo()
    reply.results[1].error.details[0].Unpack(info)
    assert (info.reason, info.domain, dict(info.metadata)) == ("INVALID_REQUEST", "prediction.mlpair", {"attributes": "tenure"})
    assert reply.results[3].error.message == "internal error"


def test_wire_values_round_trip_to_python_values():
    wire = to_attributes({"a": 1, "b": "x", "c": True, "d": None, "e": float("nan")})
    request = pb.PredictRequest(request_id="r", entity_id="e", attributes=wire, explain=True)
    parsed = converters.predict_input(request)
    assert parsed.attributes == {"a": 1.0, "b": "x", "c": True, "d": None, "e": None} and parsed.explain


def test_set_zero_values_are_values_and_only_an_unset_oneof_is_missing():
    wire = {"n": pb.AttributeValue(number_value=0.0), "s": pb.AttributeValue(string_value=""),
            "b": pb.AttributeValue(bool_value=False), "unset": pb.AttributeValue()}
    parsed = converters.predict_input(pb.PredictRequest(request_id="r", entity_id="e", attributes=wire))
    assert parsed.attributes == {"n": 0.0, "s": "", "b": False, "unset": None}
    assert type(parsed.attributes["n"]) is float and type(parsed.attributes["b"]) is bool


texts = st.text(max_size=12)
# (what the client sets, what the pipeline must get): the oneof's member keeps its type and value
# (``1.0``, ``"1"`` and ``True`` stay apart; -0.0, NaN and infinities stay what they are); present
# with no member set is missing (None)
attribute = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(lambda x: (pb.AttributeValue(number_value=x), x)),
    texts.map(lambda x: (pb.AttributeValue(string_value=x), x)),
    st.booleans().map(lambda x: (pb.AttributeValue(bool_value=x), x)),
    st.just((pb.AttributeValue(), None)),
)
item = st.tuples(texts, texts, st.sampled_from(["", "credit-risk", "é"]), st.booleans(),
                 st.dictionaries(texts, attribute, max_size=8))


def same_values(got: dict, expected: dict) -> bool:
    """Equal names, and per name the same type and value (NaN equal to NaN, -0.0 apart from 0.0)."""
    def seen(v):
        return type(v), (repr(v) if isinstance(v, float) and (math.isnan(v) or v == 0.0) else v)
    return got.keys() == expected.keys() and all(seen(got[k]) == seen(expected[k]) for k in got)


@settings(max_examples=200, deadline=None)
@given(st.lists(item, max_size=6), st.one_of(st.none(), st.floats(0, 1e6)))
def test_generated_requests_reach_the_pipeline_with_each_value_as_sent(items, deadline):
    """Through the wire and protobuf's parse, Predict and each BatchPredict item give the same
    ids, model name, explain flag and deadline, and every attribute value as sent."""
    request = pb.BatchPredictRequest(requests=[
        pb.PredictRequest(request_id=rid, entity_id=eid, model_name=model, explain=explain,
                          attributes={name: wire for name, (wire, _) in attributes.items()})
        for rid, eid, model, explain, attributes in items])
    parsed = pb.BatchPredictRequest.FromString(request.SerializeToString())
    batch = converters.batch_inputs(parsed, deadline)
    singles = [converters.predict_input(pb.PredictRequest.FromString(r.SerializeToString()), deadline)
               for r in parsed.requests]
    assert len(batch) == len(singles) == len(items)
    for got_batch, got_single, (rid, eid, model, explain, attributes) in zip(batch, singles, items):
        expected = {name: value for name, (_, value) in attributes.items()}
        for got in (got_batch, got_single):
            assert (got.request_id, got.entity_id, got.model_name, got.explain, got.deadline) == \
                (rid, eid, model, explain, deadline)
            assert same_values(got.attributes, expected), (got.attributes, expected)


def served_deserializers():
    """PredictionService's request deserializers as the server registers them."""
    from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
    from mlpair.rpc.servicers import _Captured, add_servicer

    server = _Captured()
    add_servicer(pb_grpc.add_PredictionServiceServicer_to_server, pb_grpc.PredictionServiceServicer(), server)
    return {name: handler.request_deserializer for name, handler in server.handlers.items()}


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def delimited(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


UNUSED = varint(9 << 3 | 0) + varint(7)  # field 9: no PredictRequest, AttributeValue or map entry defines it
ITEM = delimited(1, b"r") + delimited(2, b"e") + delimited(3, delimited(1, b"a") + delimited(2, delimited(2, b"rent")))


def test_a_served_batch_is_parsed_strictly_and_fields_the_contract_does_not_define_are_refused():
    """Readable bytes reach the handler as the parsed message; a field the contract does not
    define, at any depth, as the strict parser's refusal (UNKNOWN_FIELD); bytes that are no
    message as the malformed marker: nothing is read past a field the service does not know."""
    from mlpair.rpc.servicers import _UNDECODABLE
    from mlpair.wire import Refused

    read = served_deserializers()
    for name in ("BatchPredict", "Predict"):
        wrap = (lambda item: delimited(1, item)) if name == "BatchPredict" else (lambda item: item)
        got = read[name](wrap(ITEM))
        item = got.requests[0] if name == "BatchPredict" else got
        assert converters.predict_input(item).attributes == {"a": "rent"}
        for damaged in (
            UNUSED + ITEM,  # in the item
            ITEM + delimited(3, delimited(1, b"b") + UNUSED),  # in a map entry
            ITEM + delimited(3, delimited(1, b"b") + delimited(2, UNUSED)),  # in a value
        ):
            assert isinstance(read[name](wrap(damaged)), Refused), damaged
        assert read[name](wrap(ITEM)[:-3]) is _UNDECODABLE
    assert isinstance(read["BatchPredict"](UNUSED + delimited(1, ITEM)), Refused)  # in the request


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4))
def test_damaged_bytes_never_crash_the_served_deserializer(noise, flips):
    """Any bytes — random, or a valid request with bytes changed — are a message, a refusal of
    unknown fields or the malformed marker: never an exception out of the deserializer."""
    from mlpair.rpc.servicers import _UNDECODABLE
    from mlpair.wire import Refused

    read = served_deserializers()["BatchPredict"]
    data = bytearray(delimited(1, ITEM) * 2)
    for at, value in flips:
        data[at % len(data)] = value
    for raw in (noise, bytes(data)):
        got = read(raw)
        assert got is _UNDECODABLE or isinstance(got, (Refused, pb.BatchPredictRequest))
        if isinstance(got, pb.BatchPredictRequest):
            assert len(converters.batch_inputs(got)) == len(got.requests)
