"""Bad input, PredictionService side: property-based fuzzing of Predict and BatchPredict.

Both services run as real processes (``mlpair serve``), the CRM is a throw-away PostgreSQL
database, and hypothesis generates requests: attribute values of every wire type (huge,
negative, NaN, infinite and subnormal numbers; numeric-looking, empty, very long and
non-ASCII strings; booleans; nulls), unknown and very long attribute names, empty, very long,
non-ASCII and control-character ids, unknown model families, explanations, many items, and
raw bytes that are not a valid message at all. Every answer must be a decision or a specific
client error (INVALID_ARGUMENT, NOT_FOUND; ALREADY_EXISTS only for a request id decided before
with another payload — hypothesis repeats ids; RESOURCE_EXHAUSTED only for a message above the
size limit) whose message carries no internal detail — never INTERNAL or UNKNOWN — and afterwards
the service is still SERVING and every decision it returned is in the CRM, exactly once.

``make test`` runs 30 examples per property (a few seconds); set
``MLPAIR_FUZZ_EXAMPLES`` (e.g. 2000) for a longer run.
"""

from __future__ import annotations

import json
import os
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.contracts.schema import FeatureSchema
from tests.support import CHURN_SCHEMA, CREDIT_SCHEMA
from tests.support.pair import pair, running

EXAMPLES = int(os.environ.get("MLPAIR_FUZZ_EXAMPLES", "30"))
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # PredictionService's default max_message_bytes
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
INTERNAL_DETAIL = ("Traceback", "Exception", "Error(", "File \"", "<class", "sqlalchemy", "asyncpg", "numpy")
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])

ATTRIBUTES = sorted({*FeatureSchema.from_toml(CREDIT_SCHEMA).attribute_names,
                     *FeatureSchema.from_toml(CHURN_SCHEMA).attribute_names})
text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)))  # any Unicode a proto string can hold
numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                    st.integers(-2**63, 2**63).map(float),
                    st.sampled_from([99999999.0, -1.0, 0.0, -0.0, 1e308, -1e308, 5e-324, 2.5, 12.0]))
strings = st.one_of(text.filter(lambda s: len(s) < 200), st.text(min_size=1000, max_size=20_000),
                    st.sampled_from(["", " ", "42", "-1.5e3", "nan", "inf", "1,000", "1_000", "yes", "no", "owner",
                                     " Rent ", "houseboat", "Month-to-month", "日本", "\x00", "0x1F"]))
values = st.one_of(numbers.map(lambda x: pb.AttributeValue(number_value=x)),
                   strings.map(lambda s: pb.AttributeValue(string_value=s)),
                   st.booleans().map(lambda b: pb.AttributeValue(bool_value=b)),
                   st.just(pb.AttributeValue()))
names = st.one_of(st.sampled_from(ATTRIBUTES), text.filter(lambda s: len(s) < 100), st.text(min_size=300, max_size=3000))
ids = st.one_of(st.uuids().map(str), text.filter(lambda s: len(s) <= 128), st.text(min_size=129, max_size=5000),
                st.sampled_from(["", "   ", "id\x00nul", "line\nbreak", "tab\tid", "é" * 128, "日本語-id"]))
models = st.one_of(st.sampled_from(["", "credit-risk", "churn"]), text.filter(lambda s: len(s) < 100),
                   st.text(min_size=1000, max_size=10_000))


@st.composite
def predict_requests(draw) -> pb.PredictRequest:
    return pb.PredictRequest(request_id=draw(ids), entity_id=draw(ids), model_name=draw(models),
                             attributes=draw(st.dictionaries(names, values, max_size=30)), explain=draw(st.booleans()))


@pytest.fixture(scope="module")
def served(model_repository, postgres_url, tmp_path_factory):
    """Both services as processes, serving both families; the CRM in PostgreSQL."""
    families = json.dumps(["credit-risk", "churn"])
    services = pair(tmp_path_factory.mktemp("fuzz"), model_repository, crm_url=postgres_url,
                    prediction_env={"PREDICTION_MODELS": families}, inference_env={"INFERENCE_MODELS": families})
    with running(services), grpc.insecure_channel(services.prediction.address) as channel:
        yield services, channel


@pytest.fixture(scope="module")
def decided() -> set[str]:
    """Request ids the service returned a decision for, across the module's fuzzing."""
    return set()


def check_error(error: grpc.RpcError, request_bytes: int, request_id: str = "", decided: set[str] = frozenset()) -> None:
    code = error.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        assert request_bytes > MAX_MESSAGE_BYTES, error.details()
        return
    if code == grpc.StatusCode.ALREADY_EXISTS:  # IDEMPOTENCY_KEY_REUSED: only an id already decided
        assert request_id in decided, error.details()
        return
    assert code in ALLOWED, (code, error.details())
    assert not any(marker in (error.details() or "") for marker in INTERNAL_DETAIL), error.details()
    assert len(error.details() or "") < 2000  # a refusal never echoes a client's huge input back


def check_decision(r: pb.PredictResponse, request: pb.PredictRequest) -> None:
    assert r.request_id == request.request_id and r.decision_id and r.decision_label
    assert 0.0 <= r.probability <= 1.0
    assert not r.fallback  # InferenceService is up: every decision comes from the model


@FUZZ
@given(request=predict_requests())
def test_fuzzed_predict_gets_a_decision_or_a_specific_client_error(served, decided, request):
    services, channel = served
    call = channel.unary_unary("/mlpair.prediction.v1.PredictionService/Predict",
                               request_serializer=pb.PredictRequest.SerializeToString,
                               response_deserializer=pb.PredictResponse.FromString)
    try:
        reply = call(request, timeout=20)
    except grpc.RpcError as error:
        check_error(error, request.ByteSize(), request.request_id, decided)
    else:
        check_decision(reply, request)
        decided.add(request.request_id)
    assert services.prediction.alive() and services.inference.alive()


@FUZZ
@given(requests=st.lists(predict_requests(), max_size=60), copies=st.integers(1, 30))
def test_fuzzed_batch_predict_answers_every_item_in_order(served, decided, requests, copies):
    services, channel = served
    call = channel.unary_unary("/mlpair.prediction.v1.PredictionService/BatchPredict",
                               request_serializer=pb.BatchPredictRequest.SerializeToString,
                               response_deserializer=pb.BatchPredictResponse.FromString)
    items = (requests * copies)[:1200]  # many items, duplicated ids, sometimes above max_batch_items (1,000)
    message = pb.BatchPredictRequest(requests=items)
    try:
        reply = call(message, timeout=60)
    except grpc.RpcError as error:
        check_error(error, message.ByteSize())
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
            assert len(items) > 1000, error.details()  # the whole call is refused only for too many items
        return
    assert len(reply.results) == len(items)
    for request, result in zip(items, reply.results):
        if result.WhichOneof("outcome") == "error":
            if result.error.code == 6:  # ALREADY_EXISTS: an id decided before, with another payload
                assert request.request_id in decided, result.error.message
                continue
            assert result.error.code in (3, 5), (result.error.code, result.error.message)  # INVALID_ARGUMENT, NOT_FOUND
            assert not any(marker in result.error.message for marker in INTERNAL_DETAIL), result.error.message
        else:
            check_decision(result.prediction, request)
            decided.add(request.request_id)
    assert services.prediction.alive() and services.inference.alive()


@FUZZ
@given(raw=st.binary(max_size=4096))
def test_bytes_that_are_not_a_message_are_invalid_argument(served, raw):
    services, channel = served
    for method in ("Predict", "BatchPredict"):
        call = channel.unary_unary(f"/mlpair.prediction.v1.PredictionService/{method}")  # raw bytes out and in
        try:
            call(raw, timeout=20)
        except grpc.RpcError as error:
            check_error(error, len(raw))
    assert services.prediction.alive()


def test_still_serving_and_every_fuzzed_decision_reached_the_crm_once(served, decided, postgres_url):
    import asyncio

    from sqlalchemy import func, select

    from mlpair.prediction.recording.models import DecisionRecord
    from mlpair.prediction.recording.store import make_engine

    services, channel = served
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING

    async def crm() -> tuple[set[str], int]:
        engine = make_engine(postgres_url)
        try:
            async with engine.connect() as conn:
                found = set((await conn.execute(select(DecisionRecord.request_id))).scalars())
                total = await conn.scalar(select(func.count()).select_from(DecisionRecord))
        finally:
            await engine.dispose()
        return found, total

    deadline = time.monotonic() + 30
    while True:  # the relay delivers moments after the answers; nothing may stay stuck in the ledger
        found, total = asyncio.run(crm())
        if decided <= found or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert decided <= found, f"{len(decided - found)} decision(s) never reached the CRM"
    assert total == len(found)  # no request id twice
