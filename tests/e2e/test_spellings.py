"""C51: a request id's payload is compared as the feature schema reads it, not as it is spelt.

Real processes: the replicas cluster (``conftest.replicas``: PredictionService processes over one
InferenceService, one decision ledger in PostgreSQL). A first call and its retry go through
Predict and BatchPredict, each way round, to two different replicas. A BatchPredict carries at
least 8 items of each family, so its fingerprints take the columnar path; a Predict takes the
row-wise one. Every spelling pair below is one value to the schema (a retry: the recorded
decision comes back); every differing pair is two values (a reuse of the id: refused).
"""

from __future__ import annotations

import uuid

import grpc
import pytest
from google.rpc import error_details_pb2
from sqlalchemy import text

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.prediction.preparing.idempotency import request_fingerprint
from mlpair.prediction.recording.models import LEDGER_SCHEMA, LEDGER_TABLE
from mlpair.prediction.recording.store import make_engine
from tests.e2e.replicas import refusal_reason, request

pytestmark = pytest.mark.timeout(240)
A, B = 0, 1  # two healthy replicas of conftest.replicas
FILLERS = 8  # unchanged items per family in a BatchPredict: each family's rows take the columnar path

# (family, attribute, first spelling, retried spelling): one value to the feature schema
SAME = [
    ("credit-risk", "Debt", 0.0, -0.0),
    ("credit-risk", "Debt", -0.0, 0.0),
    ("credit-risk", "Age", 30.0, "30"),  # strings = "parse": a decimal string is its number
    ("credit-risk", "Age", " 3.0e1 ", 30.0),
    ("credit-risk", "Home", "owner", " OWNER "),  # normalize = "trim_lower"
    ("churn", "tenure", 12.0, "12"),  # type = "integer"
    ("churn", "senior_citizen", True, " Y "),  # type = "boolean": true, 1, yes, y
    ("churn", "partner", 0.0, False),
    ("churn", "online_security", True, " YES "),  # booleans = "yes_no", then trim_lower
    ("churn", "monthly_charges", -0.0, "0"),
]
# (family, attribute, first value, retried value): two values the schema reads apart
DIFFERENT = [
    ("credit-risk", "Debt", 0.0, 5.0),
    ("credit-risk", "Age", 30.0, "31"),
    ("credit-risk", "Home", "owner", "rent"),
    ("credit-risk", "Income", 99999999.0, None),  # a sentinel and an absent value: other reason codes
    ("churn", "senior_citizen", True, False),
    ("churn", "online_security", True, "no"),
    ("churn", "tenure", "12", 13.0),
]
ROUTES = [("Predict", "Predict"), ("BatchPredict", "BatchPredict"), ("Predict", "BatchPredict"),
          ("BatchPredict", "Predict")]


@pytest.fixture(scope="module")
def bases(credit_holdout, churn_holdout) -> dict[str, list[dict]]:
    """Real holdout records of each family (credit applicants under 95: ``conftest.replicas``' model
    is the real one for them)."""
    return {"credit-risk": [r for r in credit_holdout.records if float(r["Age"]) < 90][:FILLERS + 1],
            "churn": list(churn_holdout.records[:FILLERS + 1])}


def spelt(bases: dict, family: str, attribute: str, value) -> dict:
    record = dict(bases[family][0])
    if value is None:
        record.pop(attribute, None)
    else:
        record[attribute] = value
    return record


async def send(replicas, route: str, replica: int, items: list[pb.PredictRequest], fillers: list[pb.PredictRequest]):
    """Each item's outcome: its PredictResponse, or its error as (gRPC code, ErrorInfo reason)."""
    stub = replicas.stubs[replica]
    if route == "Predict":
        out = []
        for item in items:
            try:
                out.append(await stub.Predict(item, timeout=30))
            except grpc.aio.AioRpcError as exc:
                out.append((exc.code(), refusal_reason(exc)))
        return out
    reply = await stub.BatchPredict(pb.BatchPredictRequest(requests=[*items, *fillers]), timeout=60)
    out = []
    for result in reply.results[: len(items)]:
        if result.WhichOneof("outcome") == "prediction":
            out.append(result.prediction)
        else:
            info = error_details_pb2.ErrorInfo()
            assert result.error.details[0].Unpack(info)
            out.append((grpc.StatusCode.ALREADY_EXISTS if result.error.code == 6 else result.error.code, info.reason))
    return out


def items(pairs: list, bases: dict, prefix: str, which: int) -> list[pb.PredictRequest]:
    return [request(f"{prefix}-{k}", spelt(bases, family, attribute, values[which]), model_name=family)
            for k, (family, attribute, *values) in enumerate(pairs)]


def fillers(bases: dict, prefix: str) -> list[pb.PredictRequest]:
    return [request(f"{prefix}-fill-{family}-{i}", record, model_name=family)
            for family, records in bases.items() for i, record in enumerate(records[1:])]


async def test_c51_two_spellings_of_one_value_are_a_retry_in_predict_batch_and_across(replicas, bases):
    replayed = 0
    for first_route, retry_route in ROUTES:
        prefix = f"c51-same-{first_route}-{retry_route}-{uuid.uuid4().hex[:8]}"
        first = await send(replicas, first_route, A, items(SAME, bases, prefix, 0), fillers(bases, prefix + "-a"))
        assert all(isinstance(r, pb.PredictResponse) and not r.replayed for r in first), first
        retry = await send(replicas, retry_route, B, items(SAME, bases, prefix, 1), fillers(bases, prefix + "-b"))
        for pair, original, again in zip(SAME, first, retry):
            assert isinstance(again, pb.PredictResponse), (first_route, retry_route, pair, again)
            assert again.replayed and again.decision_id == original.decision_id
            assert (again.decision_label, again.probability) == (original.decision_label, original.probability)
            replayed += 1
    assert replayed == len(SAME) * len(ROUTES) == 40


async def test_c51_two_values_the_schema_reads_apart_are_still_refused_as_a_reused_id(replicas, bases):
    refused = 0
    for first_route, retry_route in ROUTES:
        prefix = f"c51-diff-{first_route}-{retry_route}-{uuid.uuid4().hex[:8]}"
        first = await send(replicas, first_route, A, items(DIFFERENT, bases, prefix, 0), fillers(bases, prefix + "-a"))
        assert all(isinstance(r, pb.PredictResponse) for r in first), first
        retry = await send(replicas, retry_route, B, items(DIFFERENT, bases, prefix, 1), fillers(bases, prefix + "-b"))
        for pair, again in zip(DIFFERENT, retry):
            assert again == (grpc.StatusCode.ALREADY_EXISTS, "IDEMPOTENCY_KEY_REUSED"), (first_route, retry_route, pair)
            refused += 1
    assert refused == len(DIFFERENT) * len(ROUTES) == 28


async def test_c51_a_ledger_row_holding_the_fingerprint_of_the_values_as_sent_replays_them(replicas, bases):
    """A row whose fingerprint was taken over the values as sent (a replica of a release that
    fingerprinted spellings, during a rolling upgrade): the same values sent again are a retry,
    other values are still refused."""
    sent = spelt(bases, "churn", "online_security", " YES ")
    first_request = request(f"c51-ledger-{uuid.uuid4().hex[:8]}", sent, model_name="churn")
    first = await replicas.stubs[A].Predict(first_request, timeout=30)
    as_sent = {name: getattr(v, v.WhichOneof("kind")) if v.WhichOneof("kind") else None
               for name, v in first_request.attributes.items()}
    engine = make_engine(replicas.crm_url)
    try:
        async with engine.begin() as conn:
            updated = await conn.execute(
                text(f"UPDATE {LEDGER_SCHEMA}.{LEDGER_TABLE} SET fingerprint = :f WHERE request_id = :r"),
                {"f": request_fingerprint("churn", first_request.entity_id, as_sent), "r": first_request.request_id})
            assert updated.rowcount == 1
    finally:
        await engine.dispose()
    again = await replicas.stubs[B].Predict(first_request, timeout=30)
    assert again.replayed and again.decision_id == first.decision_id
    other = request(first_request.request_id, spelt(bases, "churn", "online_security", "no"), model_name="churn")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await replicas.stubs[B].Predict(other, timeout=30)
    assert (refused.value.code(), refusal_reason(refused.value)) == (grpc.StatusCode.ALREADY_EXISTS,
                                                                     "IDEMPOTENCY_KEY_REUSED")
