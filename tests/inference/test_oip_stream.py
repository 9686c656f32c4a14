"""OIP ModelStreamInfer: the unary path per request, errors on the stream, backpressure,
cancellation (queued rows never computed, counted exactly) and drain."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from prometheus_client import REGISTRY

from mlpair.api.oip import grpc_predict_v2_pb2 as oip
from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from mlpair.rpc import error_info
from tests.inference.helpers import MODEL, channel_to, gated, make_settings, running, wait_for
from tests.support.inference import oip_logits, oip_request, with_parameter

pytestmark = pytest.mark.timeout(60)


def cancelled_count(version: str = "1") -> float:
    return REGISTRY.get_sample_value("inference_queue_dropped_total",
                                     {"model": MODEL, "version": version, "reason": "cancelled"}) or 0.0


async def test_each_request_is_answered_in_order_like_a_unary_call(stub, holdout_x, feature_version):
    requests = [oip_request(holdout_x[i:i + 1 + i % 3], feature_version=feature_version, id=f"r{i}") for i in range(20)]
    call = stub.ModelStreamInfer(iter(requests))
    replies = [reply async for reply in call]
    assert await call.code() == grpc.StatusCode.OK
    assert [r.infer_response.id for r in replies] == [f"r{i}" for i in range(20)]
    for request, reply in zip(requests, replies):
        assert reply.error_message == ""
        unary = await stub.ModelInfer(request)
        assert oip_logits(reply.infer_response).tobytes() == oip_logits(unary).tobytes()
        assert reply.infer_response.model_version == "1"


async def test_feature_version_from_the_stream_metadata(stub, holdout_x, feature_version):
    call = stub.ModelStreamInfer(iter([oip_request(holdout_x[:2], id="a")]),
                                 metadata=(("x-feature-version", feature_version),))
    (reply,) = [r async for r in call]
    assert reply.error_message == "" and oip_logits(reply.infer_response).shape == (2, 2)
    call = stub.ModelStreamInfer(iter([oip_request(holdout_x[:2], id="b", feature_version="credit-risk/v0")]),
                                 metadata=(("x-feature-version", feature_version),))
    (reply,) = [r async for r in call]
    assert "send one" in reply.error_message


async def test_bad_requests_mid_stream_get_error_responses_and_the_stream_goes_on(stub, holdout_x, feature_version):
    x = holdout_x[:1]
    nan = x.copy()
    nan[0, 3] = np.nan
    good = oip_request(x, feature_version=feature_version, id="good-1")
    requests = [good, oip_request(x, feature_version="credit-risk/v0", id="stale"),
                oip_request(nan, feature_version=feature_version, id="nan"),
                with_parameter(oip_request(x, feature_version=feature_version, id="seq"), "sequence_id", int64_param=7),
                oip_request(x, feature_version=feature_version, model_version="9", id="v9"),
                oip_request(x, feature_version=feature_version, id="good-2")]
    call = stub.ModelStreamInfer(iter(requests))
    replies = [r async for r in call]
    assert await call.code() == grpc.StatusCode.OK
    assert [r.infer_response.id for r in replies] == ["good-1", "stale", "nan", "seq", "v9", "good-2"]
    errors = {r.infer_response.id: (r.infer_response.parameters["error_code"].string_param,
                                    r.infer_response.parameters["error_reason"].string_param, r.error_message)
              for r in replies if r.error_message}
    assert errors["stale"][:2] == ("FAILED_PRECONDITION", "FEATURE_VERSION_MISMATCH")
    assert errors["nan"][:2] == ("INVALID_ARGUMENT", "INVALID_INPUT") and "row 0 column 3" in errors["nan"][2]
    assert errors["seq"][:2] == ("INVALID_ARGUMENT", "UNSUPPORTED_PARAMETER") and "sequence" in errors["seq"][2]
    assert errors["v9"][:2] == ("NOT_FOUND", "MODEL_NOT_FOUND")
    for rid in ("good-1", "good-2"):
        (reply,) = [r for r in replies if r.infer_response.id == rid]
        assert reply.error_message == "" and oip_logits(reply.infer_response).shape == (1, 2)


async def test_a_message_that_is_not_a_request_gets_an_error_response(server, holdout_x, feature_version):
    """Raw bytes on the stream: the undecodable one is answered MALFORMED_REQUEST, the next one works."""
    async with channel_to(server) as ch:
        method = ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                  request_serializer=lambda b: b,
                                  response_deserializer=oip.ModelStreamInferResponse.FromString)
        good = oip_request(holdout_x[:1], feature_version=feature_version, id="after").SerializeToString()
        replies = [r async for r in method(iter([b"\xff\xff\xff", good]))]
    assert replies[0].infer_response.parameters["error_reason"].string_param == "MALFORMED_REQUEST"
    assert replies[1].error_message == "" and replies[1].infer_response.id == "after"


@pytest.fixture
async def gated_server(model_repository):
    made: list = []
    settings = make_settings(model_repository, models=[MODEL], max_batch_size=64, max_queue_delay_ms=1,
                             inline_execution_max_ms=0, stream_max_in_flight=4, shutdown_accept_ms=0)
    async with running(settings, gated(made)) as srv:
        srv.runtime = made[0]
        srv.batcher = srv.engine.model(MODEL).batcher
        yield srv
        srv.runtime.gate.set()


async def test_cancelling_a_stream_leaves_its_queued_rows_uncomputed(gated_server, holdout_x, feature_version):
    srv, runtime = gated_server, gated_server.runtime
    stats = srv.batcher.statistics
    cancelled_before = cancelled_count()
    async with channel_to(srv) as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        runtime.close()
        call = stub.ModelStreamInfer()
        await call.write(oip_request(holdout_x[:1], feature_version=feature_version, id="first"))
        await asyncio.to_thread(runtime.entered.wait, 10)  # the first row is executing, the gate holds it
        for i in range(3):  # stream_max_in_flight = 4: these three are read and queue behind it
            await call.write(oip_request(holdout_x[1 + i:2 + i], feature_version=feature_version, id=f"q{i}"))
        await wait_for(lambda: srv.batcher.queued_rows == 3, what="3 queued rows")
        call.cancel()
        await wait_for(lambda: srv.batcher.queued_rows == 0, what="the cancelled rows to leave the queue")
        runtime.gate.set()
        await wait_for(lambda: stats.execution_count == 1, what="the executing batch to end")
        # A later request runs at once and alone: nothing of the cancelled stream was left behind.
        reply = await stub.ModelInfer(oip_request(holdout_x[:2], feature_version=feature_version))
    assert oip_logits(reply).shape == (2, 2)
    assert stats.execution_count == 2 and stats.executed_rows == 1 + 2
    assert sorted(stats.batches) == [1, 2]
    assert cancelled_count() - cancelled_before == 3


async def test_backpressure_bounds_the_requests_read_per_stream(gated_server, holdout_x, feature_version):
    srv, runtime = gated_server, gated_server.runtime
    async with channel_to(srv) as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        runtime.close()
        requests = [oip_request(holdout_x[i:i + 1], feature_version=feature_version, id=f"r{i}") for i in range(12)]
        call = stub.ModelStreamInfer()
        await call.write(requests[0])
        await asyncio.to_thread(runtime.entered.wait, 10)  # r0 executes alone behind the gate
        for request in requests[1:]:  # small messages: HTTP/2 takes them all, whether read or not
            await call.write(request)
        await call.done_writing()
        await wait_for(lambda: srv.batcher.queued_rows == 3, what="3 queued rows")
        await asyncio.sleep(0.3)  # had the server read on, rows 5..12 would be queued by now
        assert srv.batcher.queued_rows == 3  # 1 executing + 3 queued = stream_max_in_flight
        runtime.gate.set()
        replies = [r async for r in call]
    assert [r.infer_response.id for r in replies] == [f"r{i}" for i in range(12)]
    assert all(r.error_message == "" for r in replies)


async def test_drain_ends_open_streams_with_unavailable_after_answering_them(gated_server, holdout_x, feature_version):
    srv, runtime = gated_server, gated_server.runtime
    async with channel_to(srv) as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        call = stub.ModelStreamInfer()
        await call.write(oip_request(holdout_x[:1], feature_version=feature_version, id="before"))
        first = await call.read()
        runtime.close()
        await call.write(oip_request(holdout_x[1:2], feature_version=feature_version, id="in-flight"))
        await asyncio.to_thread(runtime.entered.wait, 10)
        drain = asyncio.create_task(srv.drain())
        await wait_for(lambda: srv.engine.draining, what="the drain to begin")
        runtime.gate.set()
        second = await call.read()
        with pytest.raises(grpc.aio.AioRpcError) as excinfo:
            await call.read()
        await asyncio.wait_for(drain, 15)  # shutdown_grace_s is 20: the stream did not hold the drain
    assert first.infer_response.id == "before" and first.error_message == ""
    assert second.infer_response.id == "in-flight" and second.error_message == ""
    assert excinfo.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(excinfo.value).reason == "DRAINING"


async def test_an_unexpected_error_is_answered_internal_without_its_text(model_repository, holdout_x, feature_version,
                                                                         caplog):
    async with running(make_settings(model_repository, models=[MODEL])) as srv, channel_to(srv) as ch:
        real_infer = srv.engine.infer

        async def infer(name, version, *args, **kwargs):
            if version == "13":
                raise RuntimeError("secret internal detail")
            return await real_infer(name, version, *args, **kwargs)

        srv.engine.infer = infer
        requests = [oip_request(holdout_x[:1], feature_version=feature_version, model_version="13", id="boom"),
                    oip_request(holdout_x[:1], feature_version=feature_version, id="fine")]
        replies = [r async for r in oip_grpc.GRPCInferenceServiceStub(ch).ModelStreamInfer(iter(requests))]
    boom, fine = replies
    assert boom.error_message == "internal error" and boom.infer_response.id == "boom"
    assert boom.infer_response.parameters["error_code"].string_param == "INTERNAL"
    assert "secret" not in str(boom) and "secret internal detail" in caplog.text
    assert fine.error_message == "" and oip_logits(fine.infer_response).shape == (1, 2)
