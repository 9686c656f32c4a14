"""Fuzzing the observability path: every decision shape × log level × sampling ratio × line format.

Observability never fails a request (C46). Hypothesis draws a decision shape — a model decision, a
stale result, a fallback, a replay, an explained decision, a refused request, a row whose model
output is NaN (MODEL_OUTPUT_INVALID) — with request ids of any text (personal-data look-alikes,
control characters, non-ASCII), a level for the ``mlpair`` loggers (DEBUG, INFO, WARNING), a
sampling ratio (0, 0.1, 1) and a line format (text, JSON), and sends a real Predict to a real
PredictionService (tracing on) in front of a real InferenceService. Every answer must be the
shape's own — never INTERNAL — every line written must parse and carry the decision (a null
probability where there is none), the Predict span must end with the call's status, and
``prediction_observability_errors_total`` must not move.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
import uuid

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.trace import SpanKind
from prometheus_client import REGISTRY

from mlpair import logs
from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from tests import nonfinite
from tests.e2e.conftest import inference_service
from tests.fault_support import inference_forwarder, prediction_settings
from tests.support.e2e import traced_prediction

pytestmark = pytest.mark.timeout(300)
EXAMPLES = int(os.environ.get("MLPAIR_FUZZ_EXAMPLES", "40"))
SHAPES = ("model", "stale", "fallback", "replay", "explained", "refused", "invalid_output")
PREDICT = "/mlpair.prediction.v1.PredictionService/Predict"
_fresh = itertools.count()

ids = st.one_of(st.uuids().map(str),
                st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=100),
                st.sampled_from(["jane.doe@example.com", "+34 612 345 678", "123-45-6789", "日本語-id", "é" * 100]))


@pytest.fixture(scope="module")
async def served(nonfinite_repository, tmp_path_factory):
    """Forwarder in front of InferenceService (the test fails calls to make stale results and
    fallbacks); entries are never fresh, so every call reaches inference and a failed one is stale."""
    async with inference_service(nonfinite_repository) as inference, \
            inference_forwarder(inference) as (target, forwarder):
        settings_ = prediction_settings(tmp_path_factory.mktemp("fuzz-observability"), nonfinite_repository, target,
                                        models=["credit-risk"], cache_fresh_ttl_s=0.0, inference_max_attempts=1,
                                        breaker_failure_threshold=1_000_000, inference_timeout_ms=10_000)
        async with traced_prediction(settings_) as (stub, predictor, provider, spans):
            yield stub, forwarder, provider, spans


def observability_errors() -> float:
    return sum(REGISTRY.get_sample_value("prediction_observability_errors_total", {"stage": stage}) or 0.0
               for stage in ("decision_log", "call_log", "format", "filter", "span"))


def lines_of(stream: io.StringIO, fmt: str) -> list:
    text = stream.getvalue().splitlines()
    if fmt == "json":
        return [json.loads(line) for line in text if line.strip()]
    return [line for line in text if line.strip()]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.sampled_from(SHAPES), level=st.sampled_from(["DEBUG", "INFO", "WARNING"]),
       ratio=st.sampled_from([0.0, 0.1, 1.0]), fmt=st.sampled_from(["text", "json"]), request_id=ids)
async def test_every_decision_shape_is_answered_and_logged_at_every_level_and_ratio(
        served, credit_holdout, shape, level, ratio, fmt, request_id):
    stub, forwarder, provider, spans = served
    n = next(_fresh)
    record = {**credit_holdout.records[n % 300], "Amount": 300 + n}  # a row of its own
    rid = f"{request_id[:80]}-{uuid.uuid4().hex[:8]}"
    if shape == "stale":  # decided once (cached), then inference fails: the cached logits are served stale
        await stub.Predict(request(f"warm-{rid}", record), timeout=20)
    if shape == "replay":
        await stub.Predict(request(rid, record), timeout=20)
    if shape in ("stale", "fallback"):
        forwarder.fail_first = [grpc.StatusCode.UNAVAILABLE]
    if shape == "invalid_output":
        record = nonfinite.bad(record)
    if shape == "refused":
        record = {**record, "Age": "not a number"}

    stream = io.StringIO()
    handler = logs.make_handler(fmt, stream)
    mlpair_logger = logging.getLogger("mlpair")
    previous_level, previous_ratio = mlpair_logger.level, logs.set_sample_ratio(ratio)
    mlpair_logger.addHandler(handler)
    mlpair_logger.setLevel(level)
    errors_before = observability_errors()
    provider.force_flush()
    spans.clear()
    try:
        try:
            reply = await stub.Predict(request(rid, record, explain=shape == "explained"), timeout=20)
        except grpc.aio.AioRpcError as exc:
            reply = exc
    finally:
        mlpair_logger.removeHandler(handler)
        mlpair_logger.setLevel(previous_level)
        logs.set_sample_ratio(previous_ratio)
        forwarder.fail_first = []

    if shape == "refused":
        assert reply.code() == grpc.StatusCode.INVALID_ARGUMENT
    else:
        assert isinstance(reply, pb.PredictResponse), reply
        expected = {"model": (False, False, False), "explained": (False, False, False),
                    "stale": (True, False, False), "fallback": (False, True, False),
                    "invalid_output": (False, True, False), "replay": (False, False, True)}[shape]
        assert (reply.stale, reply.fallback, reply.replayed) == expected
        assert (shape != "explained") or len(reply.contributions) > 0
        assert (shape != "invalid_output") or reply.reason_codes[0] == "MODEL_OUTPUT_INVALID"

    lines = lines_of(stream, fmt)  # every line written parses (JSON) or is text
    decisions = [line for line in lines if (line["message"] if fmt == "json" else line).find("decision ") >= 0]
    logged = shape != "refused" and (level == "DEBUG" or (level == "INFO" and ratio == 1.0))
    if logged:
        assert len(decisions) == 1
        if fmt == "json":
            assert decisions[0]["decision"] == reply.decision_label
            assert decisions[0]["replayed"] == reply.replayed
            assert (decisions[0]["probability"] is None) == reply.fallback
    elif level == "WARNING" or ratio == 0.0 or shape == "refused":
        assert decisions == []
    provider.force_flush()
    [span] = [s for s in spans.get_finished_spans() if s.name == PREDICT and s.kind == SpanKind.SERVER]
    assert span.attributes["rpc.grpc.status_code"] == (3 if shape == "refused" else 0)
    assert observability_errors() == errors_before


def request(rid: str, record: dict, explain: bool = False) -> pb.PredictRequest:
    return pb.PredictRequest(request_id=rid, entity_id="e", model_name="credit-risk",
                             attributes=to_attributes(record), explain=explain)
