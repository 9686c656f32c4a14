"""Log lines of the real pair: the fields every line carries, per layer, and personal data redacted."""

from __future__ import annotations

import io
import json
import logging

import pytest

from mlpair import logs
from tests.observability.pair import predict_request

CONTEXT_FIELDS = {"ts", "level", "logger", "layer", "message", "trace_id", "span_id", "request_id", "model_version"}


async def test_every_line_carries_layer_trace_span_request_and_model_version(pair, credit_holdout, credit_entry):
    pair.clear()
    reply = await pair.stub.Predict(predict_request("logs-1", credit_holdout.entity_ids[2], credit_holdout.records[2]))
    lines = await pair.settled_log_lines()
    assert lines, "DEBUG is on for mlpair: each call writes its lines"
    for line in lines:
        assert set(line) >= CONTEXT_FIELDS, line
        assert len(line["trace_id"]) == 32 and len(line["span_id"]) == 16
        assert line["request_id"] == "logs-1"
        assert line["model_version"] == credit_entry.manifest.model_version
    assert len({line["trace_id"] for line in lines}) == 1, "both layers' lines share the trace id"

    (inference,) = [line for line in lines if line["layer"] == "inference"]
    assert inference["code"] == "OK" and inference["rows"] == 1
    assert len(inference["inference_id"]) == 16 and inference["batch_id"]
    assert inference["input_fingerprint"].startswith("blake2b:")
    # dynamic batching: the request waits for its batch, queue time and compute together
    assert {"validate", "queue_and_compute", "total"} <= set(inference["timings_ms"])
    assert all(v >= 0 for v in inference["timings_ms"].values())

    (decision,) = [line for line in lines if line["layer"] == "prediction"]
    assert decision["decision"] == _decision_name(reply.decision)
    assert decision["reason_codes"] == list(reply.reason_codes)
    assert decision["from_cache"] is False and decision["decision_id"] == reply.decision_id
    assert decision["level"] == "DEBUG"


def _decision_name(value: int) -> str:
    from mlpair.api.prediction.v1 import prediction_service_pb2 as pb

    return pb.Decision.Name(value).removeprefix("DECISION_")


async def test_same_input_same_fingerprint_and_no_raw_values(pair, credit_holdout):
    record = credit_holdout.records[3]
    pair.clear()
    for request_id in ("fp-1", "fp-2"):
        await pair.stub.Predict(predict_request(request_id, credit_holdout.entity_ids[3], record))
    inference = [line for line in await pair.settled_log_lines(2) if line["layer"] == "inference"]
    assert len(inference) == 2 and inference[0]["input_fingerprint"] == inference[1]["input_fingerprint"]
    assert inference[0]["inference_id"] != inference[1]["inference_id"]
    text = pair.log_stream.getvalue()
    for name in ("Income", "Assets", "Debt"):  # personal numeric attributes of this applicant
        if record.get(name) is not None:
            assert f'"{name}"' not in text


async def test_no_per_request_lines_at_info(pair, credit_holdout):
    """The hop budget: at INFO (production default) a call writes no line at all."""
    mlpair_logger = logging.getLogger("mlpair")
    pair.clear()
    mlpair_logger.setLevel(logging.INFO)
    try:
        await pair.stub.Predict(predict_request("quiet-1", credit_holdout.entity_ids[4], credit_holdout.records[4]))
    finally:
        mlpair_logger.setLevel(logging.DEBUG)
    assert pair.log_lines() == []


async def test_personal_data_in_request_ids_never_reaches_the_log(pair, credit_holdout):
    pair.clear()
    request_id = "ana.garcia@example.com/+34 612 345 678"
    await pair.stub.Predict(predict_request(request_id, credit_holdout.entity_ids[5], credit_holdout.records[5]))
    lines = await pair.settled_log_lines()
    assert lines and {line["layer"] for line in lines} == {"inference", "prediction"}
    text = pair.log_stream.getvalue()
    assert "ana.garcia" not in text and "612 345 678" not in text
    assert all(line["request_id"] == "[REDACTED:email]/[REDACTED:phone]" for line in lines)


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_schema_flagged_fields_and_patterns_are_redacted_in_both_formats(fmt, credit_schema):
    logs.add_personal_fields(credit_schema.personal_data)
    stream = io.StringIO()
    logger = logging.getLogger("mlpair.test.redaction")
    handler = logs.make_handler(fmt, stream)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.info("applicant Income=4321 Marital: widow, call 555-123-4567", extra={
            "attributes": {"Income": 98765, "Assets": 123456, "Age": 41, "Marital": "widow"},
            "contact": "ssn 123-45-6789, dni 12345678Z, mail ana@example.com"})
        try:
            raise ValueError("Debt='777777' rejected for 91 234 56 78")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    for raw in ("4321", "widow", "98765", "123456", "555-123-4567", "123-45-6789", "12345678Z",
                "ana@example.com", "777777", "91 234 56 78"):
        assert raw not in text, f"{raw!r} leaked in {fmt}: {text}"
    assert "41" in text, "non-personal values stay readable"
    if fmt == "json":
        first = json.loads(text.splitlines()[0])
        assert first["attributes"] == {"Income": "[REDACTED]", "Assets": "[REDACTED]", "Age": 41,
                                       "Marital": "[REDACTED]"}
        assert first["layer"] == "" and first["request_id"] == "" and first["trace_id"] == ""


def test_timestamps_versions_and_ids_are_not_mistaken_for_personal_data():
    from mlpair.observability.redaction import Redactor

    text = ("at 2026-11-30 12:00:01.123 model 1.45.2 took 12.345 ms on port 50051, "
            "trace 4bf92f3577b34da6a3ce929d0e0e4736 span 00f067aa0ba902b7 p=0.123456789 sha256:0123456789abcdef")
    assert Redactor().text(text) == text


@pytest.mark.parametrize("raw, redacted", [
    ("ssn-123-45-6789", "ssn-[REDACTED:national_id]"),
    ("app_123-45-6789", "app_[REDACTED:national_id]"),
    ("app_4111111111111111", "app_[REDACTED:number]"),
    ("loan-12345678Z", "loan-[REDACTED:national_id]"),
    ("cust_X1234567L", "cust_[REDACTED:national_id]"),
    ("ni-AB123456C", "ni-[REDACTED:national_id]"),
])
def test_id_numbers_joined_to_a_prefix_in_a_request_id_are_redacted(raw, redacted):
    # Callers build request ids from a prefix and a number: "-" or "_" must not hide the number.
    from mlpair.observability.redaction import Redactor

    assert Redactor().text(raw) == redacted
    assert Redactor().text(f"request {raw} refused") == f"request {redacted} refused"


def test_per_request_lines_can_be_sampled_at_info():
    logger = logging.getLogger("mlpair.test.sampling")
    logger.setLevel(logging.INFO)
    previous = logs._sample_ratio
    try:
        logs._sample_ratio = 0.0
        assert logs.per_request_level(logger) is None
        logs._sample_ratio = 1.0
        assert logs.per_request_level(logger) == logging.INFO
        logger.setLevel(logging.DEBUG)
        assert logs.per_request_level(logger) == logging.DEBUG
    finally:
        logs._sample_ratio = previous
        logger.setLevel(logging.NOTSET)


async def test_non_ascii_request_id_still_decides_and_is_not_forwarded(pair, credit_holdout):
    """gRPC metadata cannot carry it, so x-request-id is left out rather than failing the Infer call."""
    pair.clear()
    reply = await pair.stub.Predict(predict_request("solicitud-ñ-1", credit_holdout.entity_ids[6],
                                                    credit_holdout.records[6]))
    assert reply.decision_id
    by_layer = {line["layer"]: line for line in await pair.settled_log_lines()}
    assert by_layer["prediction"]["request_id"] == "solicitud-ñ-1"
    assert by_layer["inference"]["request_id"] == ""


async def test_a_refused_infer_call_is_logged_with_its_status_and_the_callers_request_id(pair, credit_entry):
    import grpc
    import numpy as np

    from mlpair.api.inference.v1 import inference_service_pb2 as ipb
    from mlpair.api.inference.v1 import inference_service_pb2_grpc as ipb_grpc

    x = np.zeros((1, credit_entry.manifest.n_features), dtype="<f4")
    request = ipb.InferRequest(model_name="credit-risk", inputs=ipb.Tensor(
        data_type=ipb.DATA_TYPE_FP32, shape=x.shape, content=x.tobytes()))
    pair.clear()
    async with grpc.aio.insecure_channel(pair.inference_target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as excinfo:
            await ipb_grpc.InferenceServiceStub(channel).Infer(
                request, metadata=(("x-feature-version", "credit-risk/v0"), ("x-request-id", "direct-7")))
    assert excinfo.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    (line,) = [line for line in await pair.settled_log_lines() if line["layer"] == "inference"]
    assert line["code"] == "FAILED_PRECONDITION" and line["request_id"] == "direct-7"
    assert line["input_fingerprint"].startswith("blake2b:") and "compute" not in line["timings_ms"]


def test_a_failing_log_line_is_counted_and_never_raised_into_the_request():
    """A formatter, a filter or the decision line itself failing: counted by stage, never raised."""
    import io

    from mlpair import logs

    class Unprintable:
        def __str__(self):
            raise RuntimeError("cannot be printed")

    def exploding():
        raise RuntimeError("cannot be iterated")
        yield

    counted: list[str] = []
    previous = logs.count_failures_with("prediction", counted.append)
    stream = io.StringIO()
    logger = logging.getLogger("mlpair.test.failing")
    logger.addHandler(logs.make_handler("json", stream))
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    token = logs.begin_request(logs.RequestContext("prediction", request_id="r1"))
    raise_exceptions, logging.raiseExceptions = logging.raiseExceptions, False  # no traceback on stderr
    try:
        logs.log_decision(logger, decision="REVIEW", reason_codes=["X"], from_cache=False, probability=None,
                          decision_id="d", model_version="1", extra=Unprintable())  # the formatter fails
        logs.log_decision(logger, decision="REVIEW", reason_codes=exploding(), from_cache=False, probability=None,
                          decision_id="d", model_version="1")  # building the line fails
        logs.log_decision(logger, decision="APPROVE", reason_codes=["Y"], from_cache=True, probability=0.1234567,
                          decision_id="d", model_version="1")
    finally:
        logging.raiseExceptions = raise_exceptions
        logs.end_request(token)
        logger.handlers.clear()
        logs.count_failures_with("prediction", previous)
    assert counted == ["format", "decision_log"]
    [line] = [json.loads(text) for text in stream.getvalue().splitlines()]
    assert (line["decision"], line["probability"], line["request_id"]) == ("APPROVE", 0.123457, "r1")


# ---- C60: every documented identifier form, whole with its check characters ----

IDENTIFIER_FORMS = [  # (as written, the kind it is redacted as)
    ("11010519491231002X", "national_id"), ("11010519491231002x", "national_id"),  # resident identity number
    ("110105194912310021", "national_id"), ("110105 19491231 002X", "national_id"),
    ("123-45-6789", "national_id"),  # US SSN (no check character)
    ("12345678Z", "national_id"), ("12345678-z", "national_id"), ("X1234567L", "national_id"),  # DNI, NIE
    ("AB123456C", "national_id"), ("AB 12 34 56 C", "national_id"),  # UK National Insurance number
    ("ES9121000418450200051332", "iban"), ("ES91 2100 0418 4502 0005 1332", "iban"),
    ("GB82 WEST 1234 5698 7654 32", "iban"), ("DE89370400440532013000", "iban"),
    ("4111 1111 1111 1111", "card"), ("4111-1111-1111-1111", "card"), ("3782 822463 10005", "card"),  # Visa, Amex
    ("3056 930902 5904", "card"), ("6011 0000 0000 0000 004", "card"), ("4111111111111111", "number"),
    ("ana.garcia@example.com", "email"), ("+34 612 345 678", "phone"), ("555-123-4567", "phone"),
]


def test_c60_each_documented_identifier_form_is_redacted_whole_with_its_check_characters():
    from mlpair.observability.redaction import Redactor

    redacted = 0
    for raw, kind in IDENTIFIER_FORMS:
        for text, expected in ((raw, f"[REDACTED:{kind}]"), (f"request {raw}, refused", f"request [REDACTED:{kind}], refused"),
                               (f"loan-{raw}", f"loan-[REDACTED:{kind}]")):
            if kind in ("email", "phone") and text.startswith("loan-"):
                continue  # joined to a prefix by "-": an e-mail's local part, a phone's groups
            assert Redactor().text(text) == expected, (raw, Redactor().text(text))
            redacted += 1
    assert redacted == 3 * len(IDENTIFIER_FORMS) - 3 == 66


async def test_c60_a_resident_identity_number_ending_in_x_reaches_no_log_line_and_no_error_detail(pair, credit_holdout):
    """A request id carrying one (and a model name that is one): the log lines of both services,
    Predict's and BatchPredict's error details and InferenceService's carry it redacted."""
    import grpc
    import numpy as np

    from mlpair.api.inference.v1 import inference_service_pb2 as ipb
    from mlpair.api.inference.v1 import inference_service_pb2_grpc as ipb_grpc
    from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
    from mlpair.rpc import error_info

    raw, shown = "loan-11010519491231002X", "loan-[REDACTED:national_id]"
    digits = "11010519491231002"
    pair.clear()
    first = await pair.stub.Predict(predict_request(raw, credit_holdout.entity_ids[7], credit_holdout.records[7]))
    assert first.decision_id
    lines = await pair.settled_log_lines()
    assert {line["request_id"] for line in lines if line["layer"] == "prediction"} == {shown}
    details = []
    with pytest.raises(grpc.aio.AioRpcError) as reused:  # the same id with another applicant
        await pair.stub.Predict(predict_request(raw, credit_holdout.entity_ids[8], credit_holdout.records[8]))
    assert reused.value.code() == grpc.StatusCode.ALREADY_EXISTS and shown in reused.value.details()
    details += [reused.value.details(), *error_info(reused.value).metadata.values()]
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await pair.stub.Predict(pb.PredictRequest(request_id="c60-2", entity_id="e", model_name="11010519491231002x"))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "[REDACTED:national_id]" in unknown.value.details()
    details += [unknown.value.details(), *error_info(unknown.value).metadata.values()]
    batch = await pair.stub.BatchPredict(pb.BatchPredictRequest(requests=[
        predict_request(raw, credit_holdout.entity_ids[9], credit_holdout.records[9])]))
    [item] = batch.results
    assert item.WhichOneof("outcome") == "error" and shown in item.error.message
    details.append(item.error.message)
    x = np.zeros((1, 13), dtype="<f4")
    async with grpc.aio.insecure_channel(pair.inference_target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as inference:
            await ipb_grpc.InferenceServiceStub(channel).Infer(ipb.InferRequest(
                model_name="11010519491231002X", inputs=ipb.Tensor(data_type=ipb.DATA_TYPE_FP32, shape=x.shape,
                                                                   content=x.tobytes())))
    assert "[REDACTED:national_id]" in inference.value.details()
    details += [inference.value.details(), *error_info(inference.value).metadata.values()]
    assert len([d for d in details if "REDACTED:national_id" in d]) >= 5
    text = pair.log_stream.getvalue()
    assert digits not in text and all(digits not in d for d in details)


def test_c60_an_error_naming_a_personal_attribute_keeps_its_own_words():
    """Error details lose identifier forms only: the log rule for a personal field's value
    (``Income: <value>``) would blank the service's own words after the attribute's name."""
    from mlpair.errors import ServiceError
    from mlpair.logs import add_personal_fields

    add_personal_fields(["Income"])
    error = ServiceError(
        "Income: expected a number, got a string that is not a plain decimal (request 11010519491231002X)",
        metadata={"attributes": "Income: expected a number"},
    )
    assert error.message.startswith("Income: expected a number, got a string")
    assert "11010519491231002X" not in error.message and "[REDACTED:national_id]" in error.message
    assert error.metadata["attributes"] == "Income: expected a number"
