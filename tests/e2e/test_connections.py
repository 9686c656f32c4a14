"""Connection hygiene of both services, in process: liveness apart from readiness, keepalive
settings that accept common clients (and PredictionService's own channel to InferenceService),
and gRPC server reflection."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlpair.api.oip import grpc_predict_v2_pb2 as oip
from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from mlpair.inference.settings import InferenceSettings
from mlpair.prediction.scoring.client import InferenceClient
from mlpair.prediction.settings import PredictionSettings
from mlpair.rpc import LIVENESS
from tests.e2e.conftest import inference_service
from tests.fault_support import eventually, free_port, health_of, prediction_service, prediction_settings
from tests.inference.helpers import MODEL, copy_version, make_settings, running
from tests.support.inference import slow

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PREDICTION = "mlpair.prediction.v1.PredictionService"
INFERENCE = "mlpair.inference.v1.InferenceService"
OIP = "inference.GRPCInferenceService"
# A client that pings every second, with or without calls (what many client libraries and meshes
# are configured to do); gRPC's server defaults cut such a client off after 3 s.
PINGING_CLIENT = [("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_timeout_ms", 2000),
                  ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
OBSERVE_S = 30.0  # C49: still connected after 30 s (gRPC's defaults cut such a client off after ~3 s)


async def statuses(address: str, *names: str) -> tuple[int, ...]:
    return tuple([await health_of(address, name) for name in names])


# --------------------------------------------------------------------------- liveness vs readiness


@pytest.mark.timeout(60)
async def test_inference_liveness_stays_serving_while_loading_and_draining(credit_entry, tmp_path):
    copy_version(credit_entry.path, tmp_path, "1")
    async with running(make_settings(tmp_path, shutdown_accept_ms=800, shutdown_grace_s=5), slow(load_s=1.5),
                       load=False) as server:
        address = f"127.0.0.1:{server.port}"
        loading = asyncio.create_task(server.load())
        await asyncio.sleep(0.3)
        assert not loading.done()
        # the model is loading: not ready on any name, but alive
        assert await statuses(address, LIVENESS, "", INFERENCE, OIP, MODEL) == (SERVING, *[NOT_SERVING] * 4)
        await loading
        assert await statuses(address, LIVENESS, "", INFERENCE, MODEL) == (SERVING,) * 4
        draining = asyncio.create_task(server.drain())
        await asyncio.sleep(0.2)  # inside the accept window: still serving calls, but unready everywhere
        async with grpc.aio.insecure_channel(address) as channel:
            stub = oip_grpc.GRPCInferenceServiceStub(channel)
            ready = (await stub.ServerReady(oip.ServerReadyRequest())).ready
            model_ready = (await stub.ModelReady(oip.ModelReadyRequest(name=MODEL))).ready
        assert (ready, model_ready) == (False, False)
        assert await statuses(address, LIVENESS, "", INFERENCE, OIP, MODEL) == (SERVING, *[NOT_SERVING] * 4)
        await draining


@pytest.mark.timeout(60)
async def test_inference_liveness_stays_serving_when_a_model_is_unloaded(credit_entry, tmp_path):
    copy_version(credit_entry.path, tmp_path, "1")
    async with running(make_settings(tmp_path, model_control="explicit")) as server:
        address = f"127.0.0.1:{server.port}"
        assert await statuses(address, LIVENESS, MODEL) == (SERVING, SERVING)
        await server.engine.repository.unload_model(MODEL)
        assert await statuses(address, LIVENESS, MODEL) == (SERVING, NOT_SERVING)


@pytest.mark.timeout(60)
async def test_prediction_liveness_stays_serving_while_the_ledger_is_down(model_repository, tmp_path):
    settings = prediction_settings(tmp_path, model_repository, f"127.0.0.1:{free_port()}", ledger_timeout_ms=200)
    async with prediction_service(settings) as (_, _, _, address):
        assert await statuses(address, LIVENESS, "", PREDICTION) == (SERVING, SERVING, SERVING)
        holder = sqlite3.connect(tmp_path / "ledger.sqlite", isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # the ledger can no longer take writes: no decision can be recorded
        try:
            async def unready() -> bool:
                return await statuses(address, "", PREDICTION) == (NOT_SERVING, NOT_SERVING)

            await eventually(unready)
            assert await health_of(address, LIVENESS) == SERVING
            assert await health_of(address, f"{PREDICTION}/ledger") == NOT_SERVING
        finally:
            holder.execute("ROLLBACK")
            holder.close()


# --------------------------------------------------------------------------- keepalive


async def stays_connected(target: str, options: list, seconds: float = OBSERVE_S,
                          channel: grpc.aio.Channel | None = None) -> list[str]:
    """Connects (one health Check), then records every connectivity change for ``seconds`` with no
    call in flight; [] = the connection stayed READY throughout."""
    own = channel is None
    channel = channel or grpc.aio.insecure_channel(target, options=options)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        await health.Check(health_pb2.HealthCheckRequest(service=LIVENESS), timeout=5)
        # a Watch stays open throughout, as a client watching readiness would hold one
        watch = health.Watch(health_pb2.HealthCheckRequest(service=LIVENESS)) if own else None
        if watch is not None:
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        changes: list[str] = []
        state = channel.get_state()
        assert state == grpc.ChannelConnectivity.READY
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(channel.wait_for_state_change(state), left)
            except TimeoutError:
                break
            state = channel.get_state()
            changes.append(state.name)
        if watch is not None:
            watch.cancel()
        return changes
    finally:
        if own:
            await channel.close()


@pytest.mark.timeout(90)
async def test_c49_a_client_pinging_every_second_with_a_watch_open_stays_connected_to_both_services(
        model_repository, tmp_path):
    """Both servers with default settings keep a 1 s pinging client with a health Watch open (and
    PredictionService's own InferenceService channel, pinging as often as InferenceService accepts)
    connected for 30 s; a server with gRPC's default 5 min minimum ping interval cuts the same
    client off."""
    assert PredictionSettings().inference_keepalive_ms >= InferenceSettings().keepalive_min_ping_interval_ms
    settings = prediction_settings(tmp_path, model_repository, f"127.0.0.1:{free_port()}")
    async with inference_service(model_repository) as inference_target, \
            inference_service(model_repository, keepalive_min_ping_interval_ms=300_000) as strict_target, \
            prediction_service(settings) as (_, _, _, prediction_target):
        client = InferenceClient(inference_target, timeout_ms=1000, max_message_bytes=1 << 20,
                                 keepalive_ms=InferenceSettings().keepalive_min_ping_interval_ms)
        try:
            inference, prediction, own_channel, strict = await asyncio.gather(
                stays_connected(inference_target, PINGING_CLIENT),
                stays_connected(prediction_target, PINGING_CLIENT),
                stays_connected(inference_target, [], channel=client._channel),
                stays_connected(strict_target, PINGING_CLIENT))
        finally:
            await client.close()
    assert (inference, prediction, own_channel) == ([], [], [])
    assert strict and strict[0] != "READY", strict  # the control: gRPC's defaults send GOAWAY too_many_pings


# --------------------------------------------------------------------------- reflection


def reflected_services(target: str) -> list[str]:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(target) as channel:
        return sorted(ProtoReflectionDescriptorDatabase(channel).get_services())


@pytest.mark.timeout(60)
async def test_a_reflection_client_lists_both_services(model_repository, tmp_path):
    settings = prediction_settings(tmp_path, model_repository, f"127.0.0.1:{free_port()}")
    async with inference_service(model_repository) as inference_target, \
            inference_service(model_repository, reflection=False) as quiet_target, \
            prediction_service(settings) as (_, _, _, prediction_target):
        inference = await asyncio.to_thread(reflected_services, inference_target)
        prediction = await asyncio.to_thread(reflected_services, prediction_target)
        with pytest.raises(grpc.RpcError) as off:
            await asyncio.to_thread(reflected_services, quiet_target)
    assert {INFERENCE, OIP, "grpc.health.v1.Health"} <= set(inference)
    assert {PREDICTION, "grpc.health.v1.Health"} <= set(prediction)
    assert off.value.code() == grpc.StatusCode.UNIMPLEMENTED
