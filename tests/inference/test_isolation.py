"""InferenceService never fails batch-mates for one row's output (C09, C43), on both protocols.

A real model entry whose logits are NaN for some inputs (``tests.nonfinite``) serves requests
that share one dynamic batch (a long queue delay and concurrent calls). The own API reports such a
row per row when asked (``per_row_errors``) and otherwise fails that request alone; an OIP request
is its own unit: it fails alone, and its batch-mates' logits are bit-identical to the same rows
sent alone.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from mlpair.api.inference.v1 import inference_service_pb2 as pb
from mlpair.api.inference.v1 import inference_service_pb2_grpc as pb_grpc
from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from mlpair.contracts.assembly import FeatureAssembler
from mlpair.rpc import error_info
from tests import nonfinite
from tests.inference.helpers import MODEL, channel_to, make_settings, running
from tests.support.inference import logits_of, oip_logits, oip_request, request

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
async def channel(nonfinite_repository):
    """A channel to InferenceService serving the entry; a long queue delay puts concurrent calls in one batch."""
    settings = make_settings(nonfinite_repository, models=[MODEL], max_batch_size=64, max_queue_delay_ms=50)
    async with running(settings) as server, channel_to(server) as ch:
        yield ch


@pytest.fixture(scope="module")
def rows(credit_entry, credit_holdout) -> tuple[np.ndarray, np.ndarray]:
    """(eight real holdout applicants, the same eight made bad) as model input."""
    assembler = FeatureAssembler(credit_entry.preprocessing)
    records = credit_holdout.records[:8]
    good = assembler.assemble_many(records)
    worse = assembler.assemble_many([nonfinite.bad(r) for r in records])
    assert not nonfinite.triggers(credit_entry, good).any() and nonfinite.triggers(credit_entry, worse).all()
    return good, worse


def nonfinite_rows() -> float:
    return REGISTRY.get_sample_value("inference_nonfinite_outputs_total", {"model": MODEL, "version": "1"}) or 0.0


async def test_c43_own_api_reports_a_bad_row_per_row_and_returns_the_others(channel, rows, good_metadata):
    good, worse = rows
    stub = pb_grpc.InferenceServiceStub(channel)
    alone = [logits_of(await stub.Infer(request(good[i:i + 1]), metadata=good_metadata)) for i in (0, 2)]
    before = nonfinite_rows()
    x = np.stack([good[0], worse[1], good[2]])
    reply = await stub.Infer(request(x, per_row_errors=True), metadata=good_metadata)
    assert [(e.row, e.reason) for e in reply.row_errors] == [(1, "NON_FINITE_OUTPUT")]
    logits = logits_of(reply)
    assert np.isfinite(logits).all() and (logits[1] == 0).all()
    np.testing.assert_array_equal(logits[[0, 2]], np.concatenate(alone))  # bit-identical
    assert nonfinite_rows() - before == 1


async def test_c09_without_per_row_errors_a_bad_row_fails_its_request_alone(channel, rows, good_metadata):
    good, worse = rows
    stub = pb_grpc.InferenceServiceStub(channel)
    alone = logits_of(await stub.Infer(request(good[:4]), metadata=good_metadata))
    before = nonfinite_rows()
    # one batch: the bad request between two good ones (a 50 ms queue delay gathers them)
    calls = [stub.Infer(request(good[:2]), metadata=good_metadata),
             stub.Infer(request(np.stack([good[4], worse[5], worse[6]])), metadata=good_metadata),
             stub.Infer(request(good[2:4]), metadata=good_metadata)]
    first, failed, last = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(failed, grpc.aio.AioRpcError) and failed.code() == grpc.StatusCode.INTERNAL
    assert error_info(failed).reason == "MODEL_FAILURE" and "row(s) 1, 2" in failed.details()
    np.testing.assert_array_equal(np.concatenate([logits_of(first), logits_of(last)]), alone)
    assert nonfinite_rows() - before == 2


async def test_c43_an_oip_request_with_a_bad_row_fails_alone_and_its_batch_mates_succeed(channel, rows, feature_version):
    good, worse = rows
    stub = oip_grpc.GRPCInferenceServiceStub(channel)
    alone = [oip_logits(await stub.ModelInfer(oip_request(good[i:i + 1], feature_version=feature_version)))
             for i in range(4)]
    requests = [oip_request(good[i:i + 1], feature_version=feature_version) for i in range(4)]
    requests.insert(2, oip_request(np.stack([good[4], worse[5]]), feature_version=feature_version))
    replies = await asyncio.gather(*(stub.ModelInfer(r) for r in requests), return_exceptions=True)
    failed = replies.pop(2)
    assert isinstance(failed, grpc.aio.AioRpcError) and failed.code() == grpc.StatusCode.INTERNAL
    assert error_info(failed).reason == "MODEL_FAILURE"
    for reply, own in zip(replies, alone):
        np.testing.assert_array_equal(oip_logits(reply), own)


async def test_the_stream_answers_a_bad_request_with_its_own_error_and_the_rest_normally(channel, rows, feature_version):
    good, worse = rows
    stub = oip_grpc.GRPCInferenceServiceStub(channel)
    sent = [oip_request(good[:1], feature_version=feature_version, id="a"),
            oip_request(worse[:1], feature_version=feature_version, id="b"),
            oip_request(good[1:2], feature_version=feature_version, id="c")]
    answers = [a async for a in stub.ModelStreamInfer(iter(sent))]
    assert [a.error_message == "" for a in answers] == [True, False, True]
    assert answers[1].infer_response.id == "b"
    assert answers[1].infer_response.parameters["error_reason"].string_param == "MODEL_FAILURE"


# -- property: bad requests in the batch change no good request's logits ------------------------

GOOD_KINDS = ("own", "own_per_row", "oip")
BAD_KINDS = ("nonfinite_own", "nonfinite_per_row", "nonfinite_oip", "nan_input", "big_header",
             "conflicting_metadata", "unknown_field", "cancelled", "expired")


@pytest.fixture(scope="module")
async def solo(channel, rows, good_metadata) -> np.ndarray:
    """Every good row's logits, each row sent alone."""
    good, _ = rows
    stub = pb_grpc.InferenceServiceStub(channel)
    return np.concatenate([logits_of(await stub.Infer(request(good[i:i + 1]), metadata=good_metadata))
                           for i in range(len(good))])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(good_kinds=st.lists(st.tuples(st.sampled_from(GOOD_KINDS), st.integers(0, 7), st.integers(1, 3)),
                           min_size=1, max_size=5),
       bad_kinds=st.lists(st.tuples(st.sampled_from(BAD_KINDS), st.integers(0, 7)), min_size=1, max_size=6))
async def test_no_bad_request_in_a_batch_changes_a_good_requests_logits(channel, rows, solo, feature_version,
                                                                       good_metadata, good_kinds, bad_kinds):
    good, worse = rows
    own, oip = pb_grpc.InferenceServiceStub(channel), oip_grpc.GRPCInferenceServiceStub(channel)

    def pick(start: int, n: int) -> list[int]:
        return [(start + k) % len(good) for k in range(n)]

    async def good_call(kind: str, start: int, n: int):
        idx = pick(start, n)
        if kind == "oip":
            return idx, oip_logits(await oip.ModelInfer(oip_request(good[idx], feature_version=feature_version)))
        reply = await own.Infer(request(good[idx], per_row_errors=kind == "own_per_row"), metadata=good_metadata)
        assert not reply.row_errors
        return idx, logits_of(reply)

    async def bad_call(kind: str, i: int):
        mixed = np.stack([good[i], worse[i]])
        try:
            if kind == "nonfinite_own":
                return await own.Infer(request(worse[i:i + 1]), metadata=good_metadata)
            if kind == "nonfinite_per_row":
                reply = await own.Infer(request(mixed, per_row_errors=True), metadata=good_metadata)
                assert [e.row for e in reply.row_errors] == [1]
                np.testing.assert_array_equal(logits_of(reply)[0], solo[i])  # its own good row too
                return reply
            if kind == "nonfinite_oip":
                return await oip.ModelInfer(oip_request(mixed, feature_version=feature_version))
            if kind == "nan_input":
                x = good[i:i + 1].copy()
                x[0, 2] = np.nan
                return await own.Infer(request(x), metadata=good_metadata)
            if kind == "big_header":
                header = (("traceparent", f"00-{'ab' * 16}-{'cd' * 8}-01"), ("tracestate", ",".join(
                    f"k{j:02d}=" + "v" * 250 for j in range(32))))
                return await own.Infer(request(good[i:i + 1]), metadata=(*good_metadata, *header))
            if kind == "conflicting_metadata":
                return await own.Infer(request(good[i:i + 1]),
                                       metadata=(*good_metadata, ("x-feature-version", "other/v9")))
            if kind == "unknown_field":
                message = pb.InferRequest.FromString(request(good[i:i + 1]).SerializeToString() + b"\x98\x06\x01")
                return await own.Infer(message, metadata=good_metadata)
            if kind == "cancelled":
                pending = own.Infer(request(good[i:i + 1]), metadata=good_metadata)
                await asyncio.sleep(0.01)
                pending.cancel()
                return await pending
            return await own.Infer(request(good[i:i + 1]), metadata=good_metadata, timeout=0.01)  # expired
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            return exc

    calls = [good_call(*g) for g in good_kinds] + [bad_call(*b) for b in bad_kinds]
    results = await asyncio.gather(*calls)
    for idx, logits in results[:len(good_kinds)]:
        np.testing.assert_array_equal(logits, solo[idx])  # bit for bit, whatever shared the batch
    for (kind, _), outcome in zip(bad_kinds, results[len(good_kinds):]):
        expected = {"nonfinite_own": grpc.StatusCode.INTERNAL, "nonfinite_oip": grpc.StatusCode.INTERNAL,
                    "nan_input": grpc.StatusCode.INVALID_ARGUMENT, "conflicting_metadata": grpc.StatusCode.INVALID_ARGUMENT,
                    "unknown_field": grpc.StatusCode.INVALID_ARGUMENT}.get(kind)
        if expected is not None:
            assert isinstance(outcome, grpc.aio.AioRpcError) and outcome.code() == expected, (kind, outcome)
