"""Proto ⇄ domain conversions: decision labels, explanations and per-item errors."""

from __future__ import annotations

from google.rpc import code_pb2, error_details_pb2

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.prediction import converters
from mlpair.prediction.records import StoredDecision
from mlpair.prediction.errors import InvalidRequest, UnknownModel
from mlpair.prediction.explain import Contribution, Explanation
from mlpair.prediction.pipeline import PredictionResult, UnexpectedFailure
from mlpair.rpc.servicers import Serialized


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
    if isinstance(reply, Serialized):  # written in wire form (the compiled part is built)
        reply = pb.BatchPredictResponse.FromString(reply.data)
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
