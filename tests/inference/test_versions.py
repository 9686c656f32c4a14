"""Model repository and versions: several side by side, policies, load/unload without restart,
a version switch under load that loses nothing, and a failed load that never turns ready (C12)."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

from mlpair.api.oip import grpc_predict_v2_pb2 as oip
from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from mlpair.inference.repository import VersionPolicy
from mlpair.rpc import error_info
from tests.inference.helpers import MODEL, channel_to, copy_version, expect_error, make_settings, running
from tests.support.inference import corrupt_model_file

Tensor = oip.ModelInferRequest.InferInputTensor


def infer_request(x: np.ndarray, feature_version: str, model: str = MODEL, version: str = "") -> oip.ModelInferRequest:
    return oip.ModelInferRequest(
        model_name=model, model_version=version,
        parameters={"x-feature-version": oip.InferParameter(string_param=feature_version)},
        inputs=[Tensor(name="features", datatype="FP32", shape=list(x.shape))], raw_input_contents=[x.tobytes()])


def logits(reply: oip.ModelInferResponse) -> np.ndarray:
    return np.frombuffer(reply.raw_output_contents[0], dtype="<f4").reshape(tuple(reply.outputs[0].shape))


@pytest.mark.parametrize("text,available,selected", [
    ("latest:1", [1, 2, 3], [3]), ("latest:2", [3, 1, 2], [2, 3]), ("all", [2, 1], [1, 2]),
    ("specific:1,3", [1, 2, 3], [1, 3]), ("specific:4", [1, 2], []),
])
def test_version_policy_selects(text, available, selected):
    assert VersionPolicy.parse(text).select(available) == selected


@pytest.mark.parametrize("text", ["latest:0", "newest", "specific:", "specific:a", "all:2"])
def test_invalid_version_policy_is_refused_by_the_settings(tmp_path, text):
    with pytest.raises(ValidationError, match="version policy"):
        make_settings(tmp_path, version_policy=text)


async def test_several_models_and_versions_serve_side_by_side(credit_entry, tmp_path, holdout_x, feature_version):
    for version in ("1", "2"):
        copy_version(credit_entry.path, tmp_path, version)
    copy_version(credit_entry.path, tmp_path, "1", model="credit-risk-shadow")
    async with running(make_settings(tmp_path, version_policy="all")) as srv, channel_to(srv) as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        x = holdout_x[:4]
        replies = {v: await stub.ModelInfer(infer_request(x, feature_version, version=v)) for v in ("1", "2", "")}
        assert [r.model_version for r in replies.values()] == ["1", "2", "2"]  # empty = highest serving
        assert logits(replies["1"]).tobytes() == logits(replies["2"]).tobytes()  # same weights
        shadow = await stub.ModelInfer(infer_request(x, feature_version, model="credit-risk-shadow"))
        assert (shadow.model_name, shadow.model_version) == ("credit-risk-shadow", "1")
        meta = await stub.ModelMetadata(oip.ModelMetadataRequest(name=MODEL))
        assert list(meta.versions) == ["1", "2"]
        err = await expect_error(stub.ModelInfer(infer_request(x, feature_version, version="3")), grpc.StatusCode.NOT_FOUND)
        assert "available: 1, 2" in err.details()
        assert error_info(err).metadata["available_versions"] == "1, 2"
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", MODEL, "credit-risk-shadow"):
            assert (await health.Check(health_pb2.HealthCheckRequest(service=name))).status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.timeout(60)
async def test_version_switch_under_load_loses_no_request(credit_entry, tmp_path, holdout_x, feature_version):
    """Clients hammer the model while version 2 appears and is loaded through the admin RPC."""
    copy_version(credit_entry.path, tmp_path, "1")
    settings = make_settings(tmp_path, model_control="explicit", max_queue_delay_ms=1)
    async with running(settings) as srv, channel_to(srv) as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        expected = logits(await stub.ModelInfer(infer_request(holdout_x[:1], feature_version)))
        seen: list[str] = []
        failures: list[str] = []
        stop = asyncio.Event()

        async def client(i: int) -> None:
            x = holdout_x[:1]
            for _ in range(5000):  # bounded; stops when told
                if stop.is_set():
                    return
                try:
                    reply = await stub.ModelInfer(infer_request(x, feature_version), timeout=10)
                    seen.append(reply.model_version)
                    if logits(reply).tobytes() != expected.tobytes():
                        failures.append("wrong logits")
                except grpc.aio.AioRpcError as exc:
                    failures.append(exc.code().name)

        clients = [asyncio.create_task(client(i)) for i in range(16)]
        await asyncio.sleep(0.5)
        copy_version(credit_entry.path, tmp_path, "2")
        await stub.RepositoryModelLoad(oip.RepositoryModelLoadRequest(model_name=MODEL), timeout=30)
        switched_at = len(seen)
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*clients)
        index = await stub.RepositoryIndex(oip.RepositoryIndexRequest())
    assert failures == []
    assert seen[:10] == ["1"] * 10 and "2" in seen
    assert set(seen[switched_at + 16:]) == {"2"}, "version 1 served after the switch completed"
    assert [(m.version, m.state) for m in index.models] == [("2", "READY")]  # latest:1 retired version 1


async def test_unload_and_load_without_restart(credit_entry, tmp_path, holdout_x, feature_version):
    copy_version(credit_entry.path, tmp_path, "1")
    copy_version(credit_entry.path, tmp_path, "1", model="credit-risk-shadow")
    async with running(make_settings(tmp_path, model_control="explicit")) as srv, channel_to(srv) as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        health = health_pb2_grpc.HealthStub(ch)
        await stub.RepositoryModelUnload(oip.RepositoryModelUnloadRequest(model_name="credit-risk-shadow"))
        assert not (await stub.ModelReady(oip.ModelReadyRequest(name="credit-risk-shadow"))).ready
        status = await health.Check(health_pb2.HealthCheckRequest(service="credit-risk-shadow"))
        assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert (await stub.ServerReady(oip.ServerReadyRequest())).ready  # an unloaded model is not expected
        await expect_error(stub.ModelInfer(infer_request(holdout_x[:1], feature_version, model="credit-risk-shadow")),
                           grpc.StatusCode.NOT_FOUND)
        await stub.RepositoryModelLoad(oip.RepositoryModelLoadRequest(model_name="credit-risk-shadow"))
        reply = await stub.ModelInfer(infer_request(holdout_x[:1], feature_version, model="credit-risk-shadow"))
        assert reply.model_name == "credit-risk-shadow"


async def test_c12_a_new_version_that_fails_to_load_is_never_ready_and_the_old_one_serves(
        credit_entry, tmp_path, holdout_x, feature_version):
    copy_version(credit_entry.path, tmp_path, "1")
    async with running(make_settings(tmp_path, model_control="explicit")) as srv, channel_to(srv) as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        corrupt_model_file(copy_version(credit_entry.path, tmp_path, "2"))
        err = await expect_error(stub.RepositoryModelLoad(oip.RepositoryModelLoadRequest(model_name=MODEL)),
                                 grpc.StatusCode.INTERNAL)
        assert "failed to load" in err.details() and "serving: previous versions" in err.details()
        assert not (await stub.ModelReady(oip.ModelReadyRequest(name=MODEL, version="2"))).ready
        index = await stub.RepositoryIndex(oip.RepositoryIndexRequest())
        states = {m.version: (m.state, m.reason) for m in index.models}
        assert states["1"] == ("READY", "") and states["2"][0] == "UNAVAILABLE" and states["2"][1]
        reply = await stub.ModelInfer(infer_request(holdout_x[:1], feature_version))
        assert reply.model_version == "1"
        assert (await stub.ServerReady(oip.ServerReadyRequest())).ready


@pytest.mark.timeout(60)
async def test_polling_the_repository_loads_a_new_version(credit_entry, tmp_path, holdout_x, feature_version):
    copy_version(credit_entry.path, tmp_path, "1")
    settings = make_settings(tmp_path, model_control="poll", repository_poll_s=0.2)
    async with running(settings) as srv, channel_to(srv) as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        copy_version(credit_entry.path, tmp_path, "2")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if (await stub.ModelReady(oip.ModelReadyRequest(name=MODEL, version="2"))).ready:
                break
            await asyncio.sleep(0.1)
        reply = await stub.ModelInfer(infer_request(holdout_x[:1], feature_version))
        assert reply.model_version == "2"
        assert not (await stub.ModelReady(oip.ModelReadyRequest(name=MODEL, version="1"))).ready
