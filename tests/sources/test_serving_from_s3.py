"""InferenceService serving from S3 (a real moto server): the same logits as from a folder, a switch
between two published versions under about 100 calls/s with no failed call, and each bad source:
unreachable at start (not ready with the reason, retried until it answers), unreachable while
serving (the loaded version keeps serving, counted), a corrupt version and an inconsistent triple
(refused with one line, the serving version untouched)."""

from __future__ import annotations

import asyncio
import json
import time

import boto3
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from mlpair.api.oip import grpc_predict_v2_pb2 as oip
from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from mlpair.sources.digest import pin
from mlpair.sources.publish import publish
from tests.inference.helpers import MODEL, channel_to, copy_version, make_settings, running
from tests.support.inference import oip_logits, oip_request
from tests.support.pair import free_port
from tests.support.stores import SECRET, moto_s3, s3_env


def source_errors(operation: str) -> float:
    return REGISTRY.get_sample_value("inference_model_source_errors_total", {"operation": operation}) or 0.0


def s3_settings(tmp_path, uri: str, **overrides):
    return make_settings(tmp_path / "unused", model_source=uri, models=[MODEL], model_cache_dir=tmp_path / "cache",
                         **overrides)


async def serving_status(ch) -> int:
    health = health_pb2_grpc.HealthStub(ch)
    return (await health.Check(health_pb2.HealthCheckRequest(service=""))).status


async def test_serves_the_same_logits_from_s3_as_from_the_folder(credit_entry, bucket, tmp_path, holdout_x,
                                                                  feature_version, model_repository):
    publish(credit_entry.path, f"s3://{bucket}/prod")
    x = holdout_x[:64]
    async with running(s3_settings(tmp_path, f"s3://{bucket}/prod")) as srv, channel_to(srv) as ch:
        remote = oip_logits(await oip_grpc.GRPCInferenceServiceStub(ch).ModelInfer(oip_request(x, feature_version=feature_version)))
        assert srv.engine.repository.serving() == {MODEL: ["1"]}
    async with running(make_settings(model_repository, models=[MODEL])) as srv, channel_to(srv) as ch:
        local = oip_logits(await oip_grpc.GRPCInferenceServiceStub(ch).ModelInfer(oip_request(x, feature_version=feature_version)))
    assert remote.tobytes() == local.tobytes()


@pytest.mark.timeout(90)
async def test_switch_between_versions_published_to_s3_under_load_fails_no_call(
        credit_entry, bucket, tmp_path, holdout_x, feature_version):
    """10 clients at 10 calls/s each while version 2 is published and found by polling."""
    uri = f"s3://{bucket}/prod"
    publish(credit_entry.path, uri)
    settings = s3_settings(tmp_path, uri, model_control="poll", repository_poll_s=0.2, max_queue_delay_ms=1)
    async with running(settings) as srv, channel_to(srv) as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        x = holdout_x[:1]
        expected = oip_logits(await stub.ModelInfer(oip_request(x, feature_version=feature_version))).tobytes()
        seen: list[tuple[float, str]] = []
        failures: list[str] = []
        sent = 0
        stop = asyncio.Event()

        async def client() -> None:
            nonlocal sent
            while not stop.is_set():
                sent += 1
                try:
                    reply = await stub.ModelInfer(oip_request(x, feature_version=feature_version), timeout=10)
                    seen.append((time.monotonic(), reply.model_version))
                    if oip_logits(reply).tobytes() != expected:
                        failures.append("wrong logits")
                except grpc.aio.AioRpcError as exc:
                    failures.append(exc.code().name)
                await asyncio.sleep(0.1)

        clients = [asyncio.create_task(client()) for _ in range(10)]
        await asyncio.sleep(1.5)
        v2 = copy_version(credit_entry.path, tmp_path / "build", "2")
        await asyncio.to_thread(publish, v2, uri)
        deadline = time.monotonic() + 30
        while srv.engine.repository.serving() != {MODEL: ["2"]} and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        switched = time.monotonic()
        await asyncio.sleep(1.5)
        stop.set()
        await asyncio.gather(*clients)
    versions = [v for _, v in seen]
    print(f"switch under load: {sent} calls sent, {len(seen)} answered, {versions.count('1')} by version 1, "
          f"{versions.count('2')} by version 2, {len(failures)} failed")
    assert failures == []
    assert len(seen) == sent and sent >= 200  # every call sent was answered (about 100/s for 3+ s)
    assert versions[:10] == ["1"] * 10 and versions[-10:] == ["2"] * 10
    assert {v for t, v in seen if t > switched + 0.2} == {"2"}


@pytest.mark.timeout(90)
async def test_unreachable_at_start_is_not_ready_with_the_reason_then_serves_once_it_answers(
        credit_entry, tmp_path, monkeypatch, caplog, feature_version, holdout_x):
    port = free_port()
    for key, value in s3_env(f"http://127.0.0.1:{port}").items():
        monkeypatch.setenv(key, value)
    before = source_errors("list")
    settings = s3_settings(tmp_path, "s3://late/prod", source_retry_max_s=4.0)
    async with running(settings, load=False) as srv, channel_to(srv) as ch:
        load = asyncio.create_task(srv.load())
        deadline = time.monotonic() + 10
        while source_errors("list") - before < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # tries at 0, 0.5, 1.5 and 3.5 s failed; the next comes 4 s later, when the bucket is filled
        assert source_errors("list") - before == 4
        assert not load.done()  # no crash: still trying
        assert await serving_status(ch) == health_pb2.HealthCheckResponse.NOT_SERVING
        reason = srv.engine.conditions()["model_source"]
        assert reason == "model source s3://late/prod: listing credit-risk failed (EndpointConnectionError)"
        assert f"not ready: {reason}; retrying in" in caplog.text
        with moto_s3(tmp_path / "moto.log", port=port):
            boto3.client("s3").create_bucket(Bucket="late")
            publish(credit_entry.path, "s3://late/prod")
            await asyncio.wait_for(load, 30)
            assert await serving_status(ch) == health_pb2.HealthCheckResponse.SERVING
            assert "model_source" not in srv.engine.conditions()
            reply = await oip_grpc.GRPCInferenceServiceStub(ch).ModelInfer(
                oip_request(holdout_x[:2], feature_version=feature_version))
            assert reply.model_version == "1"
    assert SECRET not in caplog.text


@pytest.mark.timeout(90)
async def test_unreachable_while_serving_keeps_serving_and_counts(credit_entry, tmp_path, monkeypatch, caplog,
                                                                   holdout_x, feature_version):
    port = free_port()
    for key, value in s3_env(f"http://127.0.0.1:{port}").items():
        monkeypatch.setenv(key, value)
    settings = s3_settings(tmp_path, "s3://gone/prod", model_control="poll", repository_poll_s=0.2)
    with moto_s3(tmp_path / "moto.log", port=port):
        boto3.client("s3").create_bucket(Bucket="gone")
        publish(credit_entry.path, "s3://gone/prod")
        server = running(settings)
        srv = await server.__aenter__()
    try:
        before = source_errors("list")
        await asyncio.sleep(1.5)  # several polls against a stopped server
        async with channel_to(srv) as ch:
            for _ in range(20):
                reply = await oip_grpc.GRPCInferenceServiceStub(ch).ModelInfer(
                    oip_request(holdout_x[:1], feature_version=feature_version))
                assert reply.model_version == "1"
            assert await serving_status(ch) == health_pb2.HealthCheckResponse.SERVING
        assert source_errors("list") - before >= 3
        assert "repository poll: model source s3://gone/prod: listing credit-risk failed (EndpointConnectionError)" in caplog.text
        assert SECRET not in caplog.text
    finally:
        await server.__aexit__(None, None, None)


async def test_corrupt_version_is_refused_and_the_serving_one_stays(credit_entry, bucket, tmp_path, holdout_x,
                                                                    feature_version):
    uri = f"s3://{bucket}/prod"
    publish(credit_entry.path, uri)
    async with running(s3_settings(tmp_path, uri, model_control="explicit")) as srv, channel_to(srv) as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        publish(copy_version(credit_entry.path, tmp_path / "build", "2"), uri)
        bad = b"truncated"
        boto3.client("s3").put_object(Bucket=bucket, Key=f"prod/{MODEL}/2/model.onnx", Body=bad)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RepositoryModelLoad(oip.RepositoryModelLoadRequest(model_name=MODEL))
        assert err.value.code() == grpc.StatusCode.INTERNAL
        index = {(m.version, m.state): m.reason for m in (await stub.RepositoryIndex(oip.RepositoryIndexRequest())).models}
        reason = index[("2", "UNAVAILABLE")]
        assert reason.startswith(f"credit-risk version 2: file model.onnx expected {credit_entry.manifest.model_sha256} got sha256:")
        assert "\n" not in reason and ("1", "READY") in index
        reply = await stub.ModelInfer(oip_request(holdout_x[:1], feature_version=feature_version))
        assert reply.model_version == "1"


async def test_inconsistent_triple_is_refused_and_the_serving_one_stays(credit_entry, bucket, tmp_path, holdout_x,
                                                                        feature_version):
    uri = f"s3://{bucket}/prod"
    publish(credit_entry.path, uri)
    async with running(s3_settings(tmp_path, uri, model_control="explicit")) as srv, channel_to(srv) as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        v2 = copy_version(credit_entry.path, tmp_path / "build", "2")
        manifest = json.loads((v2 / "manifest.json").read_text())
        manifest["versions"]["preprocessing_hash"] = "sha256:" + "0" * 64
        (v2 / "manifest.json").write_text(json.dumps(manifest))
        pin(v2)  # consistent digests, inconsistent triple: only the load check can see it
        client = boto3.client("s3")
        for path in sorted(v2.iterdir(), key=lambda p: p.name == "manifest.json"):
            client.upload_file(str(path), bucket, f"prod/{MODEL}/2/{path.name}")
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.RepositoryModelLoad(oip.RepositoryModelLoadRequest(model_name=MODEL))
        index = {(m.version, m.state): m.reason for m in (await stub.RepositoryIndex(oip.RepositoryIndexRequest())).models}
        assert "does not match the manifest's sha256:" + "0" * 64 in index[("2", "UNAVAILABLE")]
        assert ("1", "READY") in index
        reply = await stub.ModelInfer(oip_request(holdout_x[:1], feature_version=feature_version))
        assert reply.model_version == "1"


@pytest.mark.timeout(90)
async def test_explicit_load_while_unreachable_is_unavailable_and_the_serving_one_stays(
        credit_entry, tmp_path, monkeypatch, holdout_x, feature_version):
    port = free_port()
    for key, value in s3_env(f"http://127.0.0.1:{port}").items():
        monkeypatch.setenv(key, value)
    settings = s3_settings(tmp_path, "s3://away/prod", model_control="explicit")
    with moto_s3(tmp_path / "moto.log", port=port):
        boto3.client("s3").create_bucket(Bucket="away")
        publish(credit_entry.path, "s3://away/prod")
        server = running(settings)
        srv = await server.__aenter__()
    try:
        async with channel_to(srv) as ch:
            stub = oip_grpc.GRPCInferenceServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.RepositoryModelLoad(oip.RepositoryModelLoadRequest(model_name=MODEL))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert err.value.details() == (
                "model source s3://away/prod: listing credit-risk failed (EndpointConnectionError)")
            assert SECRET not in str(err.value.trailing_metadata())
            reply = await stub.ModelInfer(oip_request(holdout_x[:1], feature_version=feature_version))
            assert reply.model_version == "1"
            assert srv.engine.repository.serving() == {MODEL: ["1"]}
    finally:
        await server.__aexit__(None, None, None)


async def test_every_model_in_the_bucket_serves_when_none_is_named(model_repository, bucket, tmp_path):
    uri = f"s3://{bucket}/all"
    for name in ("credit-risk", "churn"):
        publish(model_repository / name / "1", uri)
    settings = make_settings(tmp_path / "unused", model_source=uri, model_cache_dir=tmp_path / "cache")
    async with running(settings) as srv:
        assert srv.engine.repository.serving() == {"churn": ["1"], "credit-risk": ["1"]}
        assert srv.engine.repository.expected == {"churn", "credit-risk"}


async def test_an_empty_bucket_refuses_the_start_with_the_fix(bucket, tmp_path):
    from mlpair.startup import StartupError

    settings = make_settings(tmp_path / "unused", model_source=f"s3://{bucket}/none", model_cache_dir=tmp_path / "c")
    with pytest.raises(StartupError) as err:
        async with running(settings):
            pass
    assert str(err.value) == (f"model source s3://{bucket}/none holds no model: publish one with "
                              f"`mlpair publish --to s3://{bucket}/none` or point INFERENCE_MODEL_SOURCE elsewhere")
