"""``mlpair.client`` against real services: InferenceService and PredictionService in this process on
free ports, serving the session's freshly trained models of both families (tests/conftest.py,
tests/e2e/conftest.py). The blocking client runs in a thread: the servers share the test's event loop."""

from __future__ import annotations

import asyncio
import datetime
import socket
import uuid
from decimal import Decimal
from fractions import Fraction

import grpc
import numpy as np
import onnxruntime as ort
import pandas as pd
import pytest

import mlpair.rpc
from mlpair import client as public
from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import (
    AsyncPredictionClient,
    BatchItem,
    ItemError,
    PredictionClient,
    check_health,
    infer_logits,
    to_attributes,
    wait_until_serving,
)
from mlpair.contracts.assembly import FeatureAssembler
from mlpair.prediction.deciding.policy import DecisionPolicy
from mlpair.rpc import error_info
from tests.e2e.conftest import prediction_server
from tests.support import CONFIG_DIR, defaulted


@pytest.fixture(scope="module")
async def prediction_target(inference_server, model_repository, tmp_path_factory):
    async with prediction_server(inference_server, model_repository, tmp_path_factory.mktemp("crm")) as (target, _):
        yield target


@pytest.fixture(scope="module")
def families(credit_entry, credit_holdout, churn_entry, churn_holdout):
    return {"credit-risk": (credit_entry, credit_holdout), "churn": (churn_entry, churn_holdout)}


def offline_logits(entry, records) -> np.ndarray:
    """The model's logits computed here: the manifest's feature assembly and ONNX Runtime."""
    x = FeatureAssembler(entry.preprocessing).assemble_many(records)
    return ort.InferenceSession(str(entry.model_path), providers=["CPUExecutionProvider"]).run(None, {"features": x})[0]


def expect_decision(reply: pb.PredictResponse, family: str, entry, record: dict) -> None:
    """The reply is the decision the model, its calibration and the family's policy make for ``record``."""
    policy = DecisionPolicy.from_toml(CONFIG_DIR / family / "policy.toml")
    manifest = entry.manifest
    probability = manifest.calibration.probabilities(offline_logits(entry, [record]), manifest.positive_index)[0]
    assert reply.probability == pytest.approx(probability, abs=1e-6)
    verdict = policy.decide(reply.probability, missing=defaulted(entry, record))  # a required attribute missing: REVIEW
    assert reply.decision_label == verdict.decision and reply.reason_codes[0] == verdict.reason_codes[0]
    assert (reply.model_version, reply.feature_schema_version) == (manifest.model_version, f"{family}/v1")
    assert (reply.policy_version, reply.calibration_method) == (policy.version, manifest.calibration.method)
    assert reply.decision_id and not reply.fallback and not reply.stale


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_to_attributes_maps_python_values_to_wire_values():
    given = pb.AttributeValue(string_value="as given")
    out = to_attributes({"n": 3, "x": 2.5, "np": np.int64(7), "flag": True, "home": "rent", "none": None,
                         "nan": float("nan"), "np_nan": np.float32("nan"), "given": given})
    assert {k: (v.WhichOneof("kind"), getattr(v, v.WhichOneof("kind")) if v.WhichOneof("kind") else None)
            for k, v in out.items()} == {
        "n": ("number_value", 3.0), "x": ("number_value", 2.5), "np": ("number_value", 7.0),
        "flag": ("bool_value", True), "home": ("string_value", "rent"), "none": (None, None),
        "nan": (None, None), "np_nan": (None, None), "given": ("string_value", "as given")}


def wire(value: pb.AttributeValue) -> tuple[str | None, object]:
    kind = value.WhichOneof("kind")
    return kind, getattr(value, kind) if kind else None


def test_to_attributes_sends_numpy_booleans_as_booleans_and_decimals_and_fractions_as_numbers():
    out = to_attributes({"np_false": np.bool_(False), "np_true": np.bool_(True), "decimal": Decimal("12.5"),
                         "decimal_inf": Decimal("-Infinity"), "fraction": Fraction(3, 4), "np_float": np.float16(2)})
    assert {k: wire(v) for k, v in out.items()} == {
        "np_false": ("bool_value", False), "np_true": ("bool_value", True), "decimal": ("number_value", 12.5),
        "decimal_inf": ("number_value", float("-inf")), "fraction": ("number_value", 0.75),
        "np_float": ("number_value", 2.0)}


def test_to_attributes_sends_every_missing_marker_as_missing():
    markers = {"pd_na": pd.NA, "pd_nat": pd.NaT, "np_nat": np.datetime64("NaT"), "np_td_nat": np.timedelta64("NaT"),
               "decimal_nan": Decimal("NaN"), "decimal_snan": Decimal("sNaN"), "none": None, "nan": float("nan")}
    assert {k: wire(v) for k, v in to_attributes(markers).items()} == {k: (None, None) for k in markers}


UNSENDABLE = {
    "a list": (["rent"], "list"), "a list of numbers": ([1, 2], "list"), "a tuple": (("rent",), "tuple"),
    "a set": ({"rent"}, "set"), "a dict": ({"a": 1}, "dict"), "bytes": (b"rent", "bytes"),
    "a complex number": (1 + 2j, "complex"), "a datetime": (datetime.datetime(2024, 1, 1), "datetime.datetime"),
    "a date": (datetime.date(2024, 1, 1), "datetime.date"),
    "a numpy datetime": (np.datetime64("2024-01-01"), "numpy.datetime64"),
    "a numpy duration": (np.timedelta64(3, "D"), "numpy.timedelta64"),
    "a pandas timestamp": (pd.Timestamp("2024-01-01"), "Timestamp"),
    "a numpy array": (np.array([1.0]), "numpy.ndarray"), "an object": (object(), "object"),
}


@pytest.mark.parametrize("value, kind", UNSENDABLE.values(), ids=UNSENDABLE.keys())
def test_to_attributes_refuses_any_other_value_naming_the_attribute_and_its_type(value, kind):
    with pytest.raises(TypeError) as excinfo:
        to_attributes({"Age": 30, "Home": value})
    assert "'Home'" in str(excinfo.value) and kind in str(excinfo.value) and "Age" not in str(excinfo.value)


async def test_both_clients_refuse_an_unsendable_attribute_before_calling_the_service():
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens: a call that went out would fail UNAVAILABLE

    def blocking():
        with PredictionClient(nowhere, timeout_s=2) as client:
            with pytest.raises(TypeError, match="'Home'"):
                client.predict("credit-risk", "e", {"Home": ["rent"]})
            with pytest.raises(TypeError, match="'Age'"):
                client.batch_predict([BatchItem("credit-risk", "e", {"Age": [1, 2]})])

    await asyncio.to_thread(blocking)
    async with AsyncPredictionClient(nowhere, timeout_s=2) as client:
        with pytest.raises(TypeError, match="'Home'"):
            await client.explain("credit-risk", "e", {"Home": np.array(["rent"])})
        with pytest.raises(TypeError, match="'Age'"):
            await client.batch_predict([BatchItem("credit-risk", "e", {"Age": b"30"})])


@pytest.mark.parametrize("family", ["credit-risk", "churn"])
async def test_predict_returns_the_recorded_decision_and_the_same_one_again(prediction_target, families, family):
    entry, holdout = families[family]
    entity, record = holdout.entity_ids[0], holdout.records[0]

    def twice():
        with PredictionClient(prediction_target) as client:
            first = client.predict(family, entity, record, request_id=f"client-{family}-1")
            return first, client.predict(family, entity, record, request_id=f"client-{family}-1")

    first, again = await asyncio.to_thread(twice)
    expect_decision(first, family, entry, record)
    assert first.request_id == f"client-{family}-1" and not first.replayed
    assert again.replayed and (again.decision_id, again.probability, again.decision_label) == (
        first.decision_id, first.probability, first.decision_label)


async def test_a_request_without_an_id_gets_a_new_uuid(prediction_target, credit_holdout):
    def one():
        with PredictionClient(prediction_target) as client:
            return client.predict("credit-risk", "no-id", credit_holdout.records[1])

    reply = await asyncio.to_thread(one)
    assert uuid.UUID(reply.request_id).version == 4 and not reply.replayed


async def test_an_empty_request_id_is_refused_rather_than_replaced(prediction_target, credit_holdout):
    """A caller whose id came out empty gets INVALID_ARGUMENT naming the field, never a decision under
    a fresh id that a retry of the same code would make again."""
    def refused():
        with PredictionClient(prediction_target) as client:
            client.predict("credit-risk", "empty-id", credit_holdout.records[2], request_id="")

    with pytest.raises(grpc.RpcError) as excinfo:
        await asyncio.to_thread(refused)
    assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(excinfo.value).metadata["field"] == "request_id"


async def test_a_bad_attribute_is_invalid_argument_and_names_it(prediction_target):
    def refused():
        with PredictionClient(prediction_target) as client:
            client.predict("credit-risk", "bad-1", {"Age": "thirty"}, request_id="client-bad-1")

    with pytest.raises(grpc.RpcError) as excinfo:
        await asyncio.to_thread(refused)
    assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Age" in excinfo.value.details() and "Traceback" not in excinfo.value.details()
    assert error_info(excinfo.value).reason == "INVALID_REQUEST"


async def test_an_unknown_family_is_not_found(prediction_target):
    def refused():
        with PredictionClient(prediction_target) as client:
            client.predict("fraud", "e", {}, request_id="client-fraud-1")

    with pytest.raises(grpc.RpcError) as excinfo:
        await asyncio.to_thread(refused)
    assert excinfo.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_info(excinfo.value).reason == "UNKNOWN_MODEL"


async def test_explain_returns_the_decision_with_every_features_contribution(prediction_target, families):
    entry, holdout = families["credit-risk"]
    record = holdout.records[2]

    def explained():
        with PredictionClient(prediction_target) as client:
            return client.explain("credit-risk", holdout.entity_ids[2], record, request_id="client-explain-1")

    reply = await asyncio.to_thread(explained)
    expect_decision(reply, "credit-risk", entry, record)
    features = set(entry.preprocessing.feature_schema.attribute_names)
    assert {c.feature for c in reply.contributions} == features
    assert all(-1.0 <= c.contribution <= 1.0 for c in reply.contributions)
    assert 1 <= len(reply.top_reasons) <= 3


async def test_batch_predict_answers_in_order_and_a_bad_item_fails_alone(prediction_target, families):
    (credit, credit_holdout), (churn, churn_holdout) = families["credit-risk"], families["churn"]
    items = [
        BatchItem("credit-risk", credit_holdout.entity_ids[3], credit_holdout.records[3], "client-batch-1"),
        BatchItem("churn", "bad", {"tenure": 1.5, "partner": "maybe"}, "client-batch-2"),
        BatchItem("churn", churn_holdout.entity_ids[3], churn_holdout.records[3], "client-batch-3"),
    ]

    def batch():
        with PredictionClient(prediction_target) as client:
            return client.batch_predict(items)

    good, bad, other = await asyncio.to_thread(batch)
    expect_decision(good, "credit-risk", credit, credit_holdout.records[3])
    expect_decision(other, "churn", churn, churn_holdout.records[3])
    assert (good.request_id, other.request_id) == ("client-batch-1", "client-batch-3")
    assert isinstance(bad, ItemError)
    assert (bad.code, bad.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST")


async def test_the_async_client_gets_the_same_recorded_decision(prediction_target, families):
    entry, holdout = families["churn"]
    entity, record = holdout.entity_ids[4], holdout.records[4]
    async with AsyncPredictionClient(prediction_target) as client:
        first, again = [await client.predict("churn", entity, record, "client-async-1") for _ in range(2)]
        [batched] = await client.batch_predict([BatchItem("churn", entity, record, "client-async-1")])
        with pytest.raises(grpc.RpcError) as excinfo:
            await client.predict("churn", "bad", {"tenure": 1.5, "partner": "maybe"}, "client-async-2")
    expect_decision(first, "churn", entry, record)
    assert again.replayed and batched.replayed and again.decision_id == batched.decision_id == first.decision_id
    assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_infer_logits_are_the_models_in_calls_of_at_most_the_given_rows(inference_server, credit_entry,
                                                                             credit_holdout):
    records = credit_holdout.records[:20]
    x = FeatureAssembler(credit_entry.preprocessing).assemble_many(records)
    manifest = credit_entry.manifest
    logits, version = await asyncio.to_thread(
        infer_logits, inference_server, "credit-risk", manifest.model_version,
        manifest.versions.feature_schema_version, x, rows_per_call=7)
    assert logits.shape == (20, 2) and logits.dtype == np.float32 and version == manifest.model_version
    np.testing.assert_allclose(logits, offline_logits(credit_entry, records), rtol=1e-5, atol=1e-5)


async def test_infer_logits_refuses_another_feature_version(inference_server, credit_entry, holdout_x):
    with pytest.raises(grpc.RpcError) as excinfo:
        await asyncio.to_thread(infer_logits, inference_server, "credit-risk", credit_entry.manifest.model_version,
                                "credit-risk/v999", holdout_x[:2])
    assert excinfo.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_infer_logits_of_zero_rows_are_the_servers_empty_logits_of_the_latest_version(inference_server,
                                                                                           credit_entry, holdout_x):
    manifest = credit_entry.manifest
    logits, version = await asyncio.to_thread(
        infer_logits, inference_server, "credit-risk", "", manifest.versions.feature_schema_version, holdout_x[:0])
    assert logits.shape == (0, 2) and logits.dtype == np.float32 and version == manifest.model_version


@pytest.mark.parametrize("model, feature_version, extra_columns, code", [
    ("fraud", None, 0, grpc.StatusCode.NOT_FOUND),
    ("credit-risk", "credit-risk/v999", 0, grpc.StatusCode.FAILED_PRECONDITION),
    ("credit-risk", None, 1, grpc.StatusCode.INVALID_ARGUMENT),
], ids=["an unknown model", "another feature version", "a column too many"])
async def test_infer_logits_of_zero_rows_are_refused_as_any_other_rows_would_be(
        inference_server, credit_entry, holdout_x, model, feature_version, extra_columns, code):
    manifest = credit_entry.manifest
    empty = np.zeros((0, holdout_x.shape[1] + extra_columns), dtype=np.float32)
    with pytest.raises(grpc.RpcError) as excinfo:
        await asyncio.to_thread(infer_logits, inference_server, model, manifest.model_version,
                                feature_version or manifest.versions.feature_schema_version, empty)
    assert excinfo.value.code() == code


async def test_health_of_both_services_and_of_nothing(inference_server, prediction_target):
    assert await asyncio.to_thread(check_health, inference_server) == "SERVING"
    assert await asyncio.to_thread(check_health, prediction_target) == "SERVING"
    assert await asyncio.to_thread(wait_until_serving, prediction_target, 5.0)
    nothing = f"127.0.0.1:{free_port()}"
    with pytest.raises(grpc.RpcError) as excinfo:
        await asyncio.to_thread(check_health, nothing, timeout_s=1.0)
    assert excinfo.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert not await asyncio.to_thread(wait_until_serving, nothing, 0.3)


def test_wait_until_serving_has_one_definition():
    assert mlpair.rpc.wait_until_serving is public.wait_until_serving


# ---- C54: a number beyond the float64 range, whatever its type ----

EDGE = 2**1024 - 2**970  # the least integer that rounds to infinity in float64 (half an ulp above the largest float)
with np.errstate(over="ignore"):
    LONG_DOUBLE_HUGE = np.longdouble("1e400") if np.finfo(np.longdouble).max > 1e400 else np.longdouble("inf")
BEYOND = {  # name: (value, the float64 it rounds to)
    "int 10**400": (10**400, np.inf), "int -10**400": (-(10**400), -np.inf), "int 2**1024": (2**1024, np.inf),
    "int at the edge": (EDGE, np.inf), "int -(at the edge)": (-EDGE, -np.inf),
    "Fraction(10**400, 1)": (Fraction(10**400, 1), np.inf), "Fraction(-10**400, 3)": (Fraction(-(10**400), 3), -np.inf),
    "Fraction at the edge": (Fraction(EDGE), np.inf), "Decimal 1e400": (Decimal("1e400"), np.inf),
    "Decimal at the edge": (Decimal(EDGE), np.inf), "Decimal -1e400": (Decimal("-1e400"), -np.inf),
    "numpy long double 1e400": (LONG_DOUBLE_HUGE, np.inf), "float inf": (float("inf"), np.inf),
    # just inside the range: the largest float64, whatever the type
    "int under the edge": (EDGE - 1, np.finfo(np.float64).max), "Fraction under the edge": (Fraction(EDGE - 1), np.finfo(np.float64).max),
    "Decimal under the edge": (Decimal(EDGE - 1), np.finfo(np.float64).max),
}


def test_c54_a_number_beyond_the_float64_range_is_sent_as_the_infinity_of_its_sign_whatever_its_type():
    sent = {name: wire(value) for name, value in to_attributes({k: v for k, (v, _) in BEYOND.items()}).items()}
    assert sent == {name: ("number_value", expected) for name, (_, expected) in BEYOND.items()}
    assert len(sent) == 16


class Unreadable(float):
    """A real number type of a caller's own whose float() fails (not for its size)."""

    def __float__(self):
        raise ValueError("secret-value-7")


async def test_c54_a_number_float_cannot_read_is_refused_naming_the_attribute_before_anything_is_sent():
    with pytest.raises(TypeError) as excinfo:
        to_attributes({"Age": 30, "Income": Unreadable(1.0)})
    message = str(excinfo.value)
    assert "'Income'" in message and "Unreadable" in message and "secret-value-7" not in message and "Age" not in message
    assert excinfo.value.__cause__ is None and excinfo.value.__suppress_context__  # no traceback shows the value
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens: a call that went out would fail UNAVAILABLE
    async with AsyncPredictionClient(nowhere, timeout_s=2) as client:
        with pytest.raises(TypeError, match="'Income'"):
            await client.predict("credit-risk", "e", {"Income": Unreadable(2.0)})


async def test_c54_equal_huge_values_of_every_type_get_one_decision(prediction_target, credit_holdout):
    """Through a real PredictionService: each huge Income is clamped to the schema's maximum (each
    huge negative one to its minimum), so every type gives one decision; a category refuses an
    infinity as it refuses a fraction, naming the attribute."""
    applicant = next(r for r in credit_holdout.records if float(r["Age"]) < 90)

    def decide(values: dict) -> dict:
        out = {}
        with PredictionClient(prediction_target) as client:
            for name, value in values.items():
                reply = client.predict("credit-risk", f"c54-{name}", {**applicant, "Income": value},
                                       request_id=f"c54-{uuid.uuid4()}")
                out[name] = (reply.decision_label, reply.probability, tuple(reply.reason_codes))
        return out

    high = {k: v for k, (v, expected) in BEYOND.items() if expected == np.inf}
    low = {k: v for k, (v, expected) in BEYOND.items() if expected == -np.inf}
    decided_high, decided_low = await asyncio.to_thread(decide, high), await asyncio.to_thread(decide, low)
    [(label, probability, reasons)] = set(decided_high.values())
    [(label_low, probability_low, reasons_low)] = set(decided_low.values())
    assert (len(decided_high), len(decided_low)) == (9, 4)
    assert "INCOME_CLAMPED_MAX" in reasons and "INCOME_CLAMPED_MIN" in reasons_low
    [(at_max, p_max, _)] = (await asyncio.to_thread(decide, {"the maximum": 5000.0})).values()
    [(at_min, p_min, _)] = (await asyncio.to_thread(decide, {"the minimum": 0.0})).values()
    assert (label, probability, label_low, probability_low) == (at_max, p_max, at_min, p_min)

    def refused(value) -> grpc.RpcError:
        with PredictionClient(prediction_target) as client, pytest.raises(grpc.RpcError) as excinfo:
            client.predict("credit-risk", "c54-home", {**applicant, "Home": value}, request_id=f"c54-{uuid.uuid4()}")
        return excinfo.value

    for value in (10**400, Fraction(-(10**400), 3), Decimal("1e400")):
        error = await asyncio.to_thread(refused, value)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "Home" in error.details()
