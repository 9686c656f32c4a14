"""OIP extensions beyond inference: ServerMetadata's list, ModelConfig, ModelStatistics (checked
against the inference_* Prometheus metrics), and request parameters honoured or refused."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from prometheus_client import REGISTRY

from mlpair.api.oip import grpc_predict_v2_pb2 as oip
from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from mlpair.rpc import error_info
from tests.inference.helpers import MODEL, channel_to, expect_error, gated, make_settings, running, wait_for
from tests.support.inference import oip_logits, oip_request, with_parameter

pytestmark = pytest.mark.timeout(60)

Output = oip.ModelInferRequest.InferRequestedOutputTensor


@pytest.fixture(scope="module")
async def server(model_repository):
    settings = make_settings(model_repository, max_batch_size=8, max_queue_delay_ms=3, preferred_batch_sizes=[4, 8],
                             execution_instances=2, version_policy="latest:2")
    async with running(settings) as srv:
        yield srv


@pytest.fixture(scope="module")
async def stub(server):
    async with channel_to(server) as ch:
        yield oip_grpc.GRPCInferenceServiceStub(ch)


async def test_server_metadata_lists_the_extensions_implemented(stub):
    meta = await stub.ServerMetadata(oip.ServerMetadataRequest())
    assert sorted(meta.extensions) == ["model_configuration", "parameters", "statistics"]


async def test_model_config_is_what_the_server_runs(stub, credit_entry):
    config = (await stub.ModelConfig(oip.ModelConfigRequest(name=MODEL))).config
    n = credit_entry.manifest.n_features
    assert (config.name, config.platform, config.backend, config.max_batch_size) == (
        MODEL, "onnxruntime_onnx", "onnxruntime", 8)
    assert config.version_policy.latest.num_versions == 2
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("features", oip.TYPE_FP32, [n])]
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [("logits", oip.TYPE_FP32, [2])]
    batching = config.dynamic_batching
    assert config.WhichOneof("scheduling_choice") == "dynamic_batching"
    assert (list(batching.preferred_batch_size), batching.max_queue_delay_microseconds) == ([4, 8], 3000)
    assert batching.default_queue_policy.allow_timeout_override
    assert (batching.priority_levels, batching.default_priority_level) == (2, 2)
    assert [(g.kind, g.count) for g in config.instance_group] == [(oip.ModelInstanceGroup.KIND_CPU, 2)]
    assert config.default_model_filename == "model.onnx"
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["max_request_rows"] == "8192" and params["feature_schema_version"] == "credit-risk/v1"
    assert params["priority_queue_rows"] == "16384,16384"
    assert params["execution"] == "executor"  # two instances never run on the event loop
    err = await expect_error(stub.ModelConfig(oip.ModelConfigRequest(name="nope")), grpc.StatusCode.NOT_FOUND)
    assert error_info(err).reason == "MODEL_NOT_FOUND"


async def test_model_config_without_batching_has_no_dynamic_batching(model_repository):
    async with running(make_settings(model_repository, models=[MODEL], batching=False)) as srv, \
            channel_to(srv) as ch:
        config = (await oip_grpc.GRPCInferenceServiceStub(ch).ModelConfig(oip.ModelConfigRequest(name=MODEL))).config
    assert config.WhichOneof("scheduling_choice") is None and config.version_policy.latest.num_versions == 1


def prometheus(version: str = "1") -> dict[str, float]:
    """The inference_* samples of credit-risk ``version`` the statistics must agree with."""
    labels = {"model": MODEL, "version": version}

    def value(name: str, **extra) -> float:
        return REGISTRY.get_sample_value(name, {**labels, **extra}) or 0.0

    codes = ("OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "CANCELLED", "DEADLINE_EXCEEDED", "INTERNAL")
    return {
        "requests": sum(value("inference_requests_total", code=c) for c in codes),
        "ok": value("inference_requests_total", code="OK"),
        "duration_count": value("inference_request_duration_seconds_count"),
        "duration_ns": value("inference_request_duration_seconds_sum") * 1e9,
        "queue_count": value("inference_queue_duration_seconds_count"),
        "queue_ns": value("inference_queue_duration_seconds_sum") * 1e9,
        "executions": value("inference_compute_duration_seconds_count"),
        "compute_ns": value("inference_compute_duration_seconds_sum") * 1e9,
        "rows_executed": value("inference_batch_size_rows_sum"),
    }


async def test_statistics_agree_with_the_prometheus_metrics(model_repository, holdout_x, feature_version):
    """A fresh server (statistics start at zero; the metrics are process-wide, so their increase is
    compared): unary and streamed requests, split ones, failed ones, then every figure matched."""
    settings = make_settings(model_repository, models=[MODEL], max_batch_size=8, max_queue_delay_ms=2)
    async with running(settings) as srv, channel_to(srv) as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        before = prometheus()
        empty = (await stub.ModelStatistics(oip.ModelStatisticsRequest(name=MODEL))).model_stats
        sizes = [1, 3, 8, 20, 1, 5]  # 20 rows > max_batch_size: split into 8 + 8 + 4
        await asyncio.gather(*(stub.ModelInfer(oip_request(holdout_x[:n], feature_version=feature_version))
                               for n in sizes))
        await expect_error(stub.ModelInfer(oip_request(holdout_x[:2], feature_version="credit-risk/v0")),
                           grpc.StatusCode.FAILED_PRECONDITION)
        stream = [oip_request(holdout_x[i:i + 2], feature_version=feature_version, id=str(i)) for i in range(10)]
        stream[4] = oip_request(holdout_x[:1], feature_version="credit-risk/v0", id="stale")
        replies = [r async for r in stub.ModelStreamInfer(iter(stream))]
        assert sum(1 for r in replies if r.error_message) == 1
        (stats,) = (await stub.ModelStatistics(oip.ModelStatisticsRequest(name=MODEL, version="1"))).model_stats
        after = prometheus()
    assert [(s.name, s.version, s.inference_count, s.execution_count) for s in empty] == [(MODEL, "1", 0, 0)]
    delta = {k: after[k] - before[k] for k in after}
    inf = stats.inference_stats
    # Outcomes: exactly what was sent, and what the metrics counted.
    assert (inf.success.count, inf.fail.count) == (len(sizes) + 9, 2)
    assert stats.inference_count == sum(sizes) + 9 * 2
    assert inf.success.count + inf.fail.count == delta["requests"] == delta["duration_count"]
    assert inf.success.count == delta["ok"]
    assert inf.success.ns + inf.fail.ns == pytest.approx(delta["duration_ns"], abs=delta["duration_count"] + 10)
    # Queue and executions: the same observations as the metrics.
    assert inf.queue.count == delta["queue_count"] == len(sizes) + 2 + 9  # the 20-row request queued 3 chunks
    assert inf.queue.ns == pytest.approx(delta["queue_ns"], abs=inf.queue.count + 10)
    assert stats.execution_count == delta["executions"] == sum(b.compute_infer.count for b in stats.batch_stats)
    assert sum(b.compute_infer.ns for b in stats.batch_stats) == pytest.approx(delta["compute_ns"],
                                                                               abs=stats.execution_count + 10)
    assert sum(b.batch_size * b.compute_infer.count for b in stats.batch_stats) == delta["rows_executed"] \
        == sum(sizes) + 9 * 2
    assert all(1 <= b.batch_size <= 8 for b in stats.batch_stats)
    assert [b.batch_size for b in stats.batch_stats] == sorted(b.batch_size for b in stats.batch_stats)
    assert inf.compute_infer.count == inf.queue.count and inf.compute_output.count == inf.queue.count
    assert stats.last_inference > 0 and not stats.memory_usage


async def test_statistics_of_every_model_and_of_unknown_ones(stub):
    everything = (await stub.ModelStatistics(oip.ModelStatisticsRequest())).model_stats
    assert [(s.name, s.version) for s in everything] == [("churn", "1"), (MODEL, "1")]
    err = await expect_error(stub.ModelStatistics(oip.ModelStatisticsRequest(name=MODEL, version="7")),
                             grpc.StatusCode.NOT_FOUND)
    assert "available: 1" in err.details()
    await expect_error(stub.ModelStatistics(oip.ModelStatisticsRequest(name="nope")), grpc.StatusCode.NOT_FOUND)


def refused_requests(x: np.ndarray, fv: str) -> dict[str, oip.ModelInferRequest]:
    def base(**kw) -> oip.ModelInferRequest:
        return oip_request(x, feature_version=fv, **kw)

    shm_input = base()
    shm_input.inputs[0].parameters["shared_memory_region"].string_param = "input0"
    shm_output = base(outputs=[Output(name="logits")])
    shm_output.outputs[0].parameters["shared_memory_region"].string_param = "output0"
    classification = base(outputs=[Output(name="logits")])
    classification.outputs[0].parameters["classification"].int64_param = 2
    return {
        "sequence": with_parameter(base(), "sequence_id", int64_param=42),
        "sequence start": with_parameter(base(), "sequence_start", bool_param=True),
        "priority as string": with_parameter(base(), "priority", string_param="high"),
        "negative priority": with_parameter(base(), "priority", int64_param=-1),
        "unknown": with_parameter(base(), "my_flag", bool_param=True),
        "timeout as string": with_parameter(base(), "timeout", string_param="5s"),
        "negative timeout": with_parameter(base(), "timeout", int64_param=-1),
        "binary_data_output as int": with_parameter(base(), "binary_data_output", int64_param=0),
        "shared memory input": shm_input,
        "shared memory output": shm_output,
        "classification": classification,
    }


@pytest.mark.parametrize("case,message", [
    ("sequence", "sequence batching is not implemented"), ("sequence start", "sequence batching"),
    ("priority as string", "'priority' must be an integer"), ("negative priority", "must not be negative"),
    ("unknown", "unknown request parameter"),
    ("timeout as string", "must be an integer"), ("negative timeout", "must not be negative"),
    ("binary_data_output as int", "must be a boolean"), ("shared memory input", "shared memory is not implemented"),
    ("shared memory output", "shared memory is not implemented"), ("classification", "raw logits only"),
])
async def test_parameters_not_implemented_are_refused(stub, holdout_x, feature_version, case, message):
    request = refused_requests(holdout_x[:1], feature_version)[case]
    err = await expect_error(stub.ModelInfer(request), grpc.StatusCode.INVALID_ARGUMENT)
    assert message in err.details() and error_info(err).reason == "UNSUPPORTED_PARAMETER"


async def test_typed_output_and_final_response_parameters_are_honoured(stub, holdout_x, feature_version):
    x = holdout_x[:3]
    raw = await stub.ModelInfer(oip_request(x, feature_version=feature_version))
    expected = oip_logits(raw)
    typed = await stub.ModelInfer(with_parameter(oip_request(x, feature_version=feature_version),
                                                 "binary_data_output", bool_param=False))
    per_output = oip_request(x, feature_version=feature_version, outputs=[Output(name="logits")])
    per_output.outputs[0].parameters["binary_data"].bool_param = False
    for reply in (typed, await stub.ModelInfer(per_output)):
        assert not reply.raw_output_contents and list(reply.outputs[0].shape) == [3, 2]
        assert np.asarray(reply.outputs[0].contents.fp32_contents, np.float32).reshape(3, 2).tobytes() == expected.tobytes()
    binary = await stub.ModelInfer(with_parameter(oip_request(x, feature_version=feature_version),
                                                  "binary_data_output", bool_param=True))
    assert oip_logits(binary).tobytes() == expected.tobytes()
    flagged = with_parameter(oip_request(x, feature_version=feature_version, id="f"),
                             "triton_enable_empty_final_response", bool_param=True)
    (reply,) = [r async for r in stub.ModelStreamInfer(iter([flagged]))]
    assert reply.infer_response.parameters["triton_final_response"].bool_param
    assert oip_logits(reply.infer_response).tobytes() == expected.tobytes()
    assert "triton_final_response" not in raw.parameters


async def test_timeout_parameter_drops_a_request_still_queued(model_repository, holdout_x, feature_version):
    """``timeout`` (µs) is honoured as a queue deadline: the request waits behind a batch held at the
    gate, times out and is never computed; without it the same request would run."""
    made: list = []
    settings = make_settings(model_repository, models=[MODEL], max_batch_size=8, inline_execution_max_ms=0)
    async with running(settings, gated(made)) as srv, channel_to(srv) as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        runtime, stats = made[0], srv.engine.model(MODEL).batcher.statistics
        runtime.close()
        blocker = asyncio.ensure_future(stub.ModelInfer(oip_request(holdout_x[:1], feature_version=feature_version)))
        await asyncio.to_thread(runtime.entered.wait, 10)
        timed = asyncio.ensure_future(stub.ModelInfer(with_parameter(
            oip_request(holdout_x[:2], feature_version=feature_version), "timeout", int64_param=50_000)))
        await wait_for(lambda: srv.engine.model(MODEL).batcher.queued_rows == 2, what="2 queued rows")
        await asyncio.sleep(0.1)  # past the 50 ms timeout while the gate holds the batcher
        runtime.gate.set()
        await blocker
        err = await expect_error(timed, grpc.StatusCode.DEADLINE_EXCEEDED)
        late = await stub.ModelInfer(with_parameter(oip_request(holdout_x[:2], feature_version=feature_version),
                                                    "timeout", int64_param=10_000_000))
    assert error_info(err).reason == "DEADLINE_EXPIRED_IN_QUEUE"
    assert oip_logits(late).shape == (2, 2)
    assert stats.executed_rows == 1 + 2 and sorted(stats.batches) == [1, 2]


def refused_count(model: str, code: str = "INVALID_ARGUMENT") -> float:
    """Calls refused before any version was chosen: counted under the model (or ``unknown``), version ""."""
    labels = {"model": model, "version": "", "code": code}
    return REGISTRY.get_sample_value("inference_requests_total", labels) or 0.0


async def test_every_refused_infer_call_is_counted_with_its_code(server, stub, holdout_x, feature_version):
    # Refused by the parameters, the metadata or the message itself, before the engine saw the
    # call: counted like the engine's own refusals, or an error ratio built on this counter
    # misses them (an internal caller's walk-through found 28 of 84 refusals uncounted).
    before = {model: refused_count(model) for model in (MODEL, "unknown")}
    good = oip_request(holdout_x[:1], feature_version=feature_version)
    unsupported = with_parameter(oip_request(holdout_x[:1], feature_version=feature_version), "foo",
                                 string_param="x")
    conflicting = [("x-feature-version", "a"), ("x-feature-version", "b")]
    await expect_error(stub.ModelInfer(unsupported), grpc.StatusCode.INVALID_ARGUMENT)
    await expect_error(stub.ModelInfer(oip.ModelInferRequest(model_name=MODEL)), grpc.StatusCode.INVALID_ARGUMENT)
    await expect_error(stub.ModelInfer(good, metadata=conflicting), grpc.StatusCode.INVALID_ARGUMENT)
    async with channel_to(server) as channel:
        raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for message in (good.SerializeToString() + b"\xf8\x06\x01", b"\xff"):  # unknown field 111; not a message
            await expect_error(raw(message), grpc.StatusCode.INVALID_ARGUMENT)
    assert refused_count(MODEL) - before[MODEL] == 3
    assert refused_count("unknown") - before["unknown"] == 2


async def test_a_call_whose_deadline_passed_is_counted_as_deadline_exceeded(model_repository, holdout_x,
                                                                            feature_version):
    # gRPC cancels the handler of a call whose deadline passes while its row waits for a batch (a
    # 50 ms queue delay here, a 5 ms deadline): that is the deadline, and a dashboard must not read
    # it as callers cancelling (they were counted CANCELLED).
    labels = {"model": MODEL, "version": "1"}

    def count(code: str) -> float:
        return REGISTRY.get_sample_value("inference_requests_total", {**labels, "code": code}) or 0.0

    settings = make_settings(model_repository, models=[MODEL], max_batch_size=64, max_queue_delay_ms=50)
    async with running(settings) as srv, channel_to(srv) as channel:
        stub = oip_grpc.GRPCInferenceServiceStub(channel)
        await stub.ModelInfer(oip_request(holdout_x[:1], feature_version=feature_version))  # connected, warm
        before = {code: count(code) for code in ("DEADLINE_EXCEEDED", "CANCELLED")}
        request = oip_request(holdout_x[:1], feature_version=feature_version)
        expired = 0
        for _ in range(20):  # a call may also be served: it joins a batch whose window a cancelled call opened
            try:
                await stub.ModelInfer(request, timeout=0.005)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED, exc.details()
                expired += 1
        assert expired >= 5
        # (a call that expired before it reached the server is counted nowhere)
        await wait_for(lambda: count("DEADLINE_EXCEEDED") > before["DEADLINE_EXCEEDED"])
        await asyncio.sleep(0.2)  # the last handlers cancelled
    assert count("CANCELLED") == before["CANCELLED"]
    assert 1 <= count("DEADLINE_EXCEEDED") - before["DEADLINE_EXCEEDED"] <= expired


def priority_count(level: int, result: str = "queued") -> float:
    """Requests of ``MODEL`` (every version) counted at ``level`` with ``result``."""
    return sum(
        sample.value
        for family in REGISTRY.collect() if family.name == "inference_priority_requests"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels["model"] == MODEL
        and sample.labels["priority"] == str(level) and sample.labels["result"] == result
    )


async def test_the_priority_parameter_is_honoured_and_an_undefined_level_refused(stub, holdout_x, feature_version):
    """Triton's ``priority``: 1 and 2 are this server's levels (2 = the default, also for 0 or no
    parameter); 3 is undefined and refused INVALID_ARGUMENT before any queueing, counted nowhere."""
    x = holdout_x[:2]
    expected = oip_logits(await stub.ModelInfer(oip_request(x, feature_version=feature_version)))
    before = {level: priority_count(level) for level in (1, 2, 3)}
    for value, kind in ((1, "uint64_param"), (1, "int64_param"), (2, "uint64_param"), (0, "uint64_param")):
        reply = await stub.ModelInfer(with_parameter(oip_request(x, feature_version=feature_version),
                                                     "priority", **{kind: value}))
        assert oip_logits(reply).tobytes() == expected.tobytes()
    assert priority_count(1) - before[1] == 2 and priority_count(2) - before[2] == 2
    for value in (3, 99):
        err = await expect_error(stub.ModelInfer(with_parameter(oip_request(x, feature_version=feature_version),
                                                                "priority", uint64_param=value)),
                                 grpc.StatusCode.INVALID_ARGUMENT)
        assert f"priority {value} is not a defined level" in err.details()
        assert error_info(err).reason == "INVALID_INPUT"
    assert priority_count(1) - before[1] == 2 and priority_count(2) - before[2] == 2
    assert priority_count(3) == before[3] == 0
