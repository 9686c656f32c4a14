"""The rendered pods start and serve: each overlay's InferenceService and every PredictionService
track run here as real servers from exactly the rendered settings, mounts and ConfigMaps (laid out
under a local folder, see pods.py), answer their probes' health names, decide for every model
family with the version their track names, record each decision in the outbox on the pod's claim
and deliver it to a real CRM database through the shared Redis cache, without writing anywhere a
read-only root filesystem would refuse.

Only what a laptop cannot have is replaced: addresses (127.0.0.1, free ports), the CRM and Redis
URLs the Secrets would hold (the test PostgreSQL and Redis), no trace collector, and the GPU
(ONNX Runtime falls back to its CPU provider when CUDA is requested and absent, and logs it).
The model repository holds credit-risk versions 1 and 2 and churn version 1, trained here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import uuid
from pathlib import Path

import deploy_checks as dc
import pods
import pytest

pytest.importorskip("mlpair.prediction.server", reason="mlpair is not installed")

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from mlpair.prediction.converters import to_attributes
from prometheus_client import REGISTRY

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from tests.support import CREDIT_SCHEMA, require_service

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def release_repository(model_repository: Path, tmp_path_factory) -> Path:
    """credit-risk 1 and churn 1 (the session's models) and credit-risk 2 (another seed, the same
    split and features): every version the overlays mount."""
    from mlpair.training.pipeline import load_train_config, train_family

    root = tmp_path_factory.mktemp("release")
    for family in ("credit-risk", "churn"):
        shutil.copytree(model_repository / family / "1", root / family / "1")
    base = load_train_config(CREDIT_SCHEMA)
    train_family(
        CREDIT_SCHEMA,
        root,
        dataclasses.replace(base, seed=base.seed + 7),
        force=True,
        show_progress=False,
    )
    assert sorted(p.name for p in (root / "credit-risk").iterdir()) == ["1", "2"]
    return root


@pytest.fixture
def redis_prefix():
    """A key prefix of this test alone; its keys are deleted afterwards."""
    require_service("Redis", "127.0.0.1", 6379)
    prefix = f"mlpair-test-deploy-{uuid.uuid4().hex[:8]}:"
    yield prefix
    import redis

    client = redis.Redis(host="127.0.0.1", port=6379)
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)
    client.close()


def settings_for(cls, pod: pods.Pod, monkeypatch: pytest.MonkeyPatch, **local: str):
    """The service's settings class read from the pod's environment, as in the container, with
    the local replacements named in the module docstring."""
    prefix = dc.PREFIX[dc.app_of(pod.workload)] + "_"
    for name in [n for n in os.environ if n.startswith(prefix)]:
        monkeypatch.delenv(name)
    for name, value in {**pod.env, **{prefix + k.upper(): v for k, v in local.items()}}.items():
        monkeypatch.setenv(name, value)
    return cls()


async def health_of(target: str, service: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return reply.status


async def assert_probes_pass(workload: dict, target: str) -> None:
    container = dc.pod_spec(workload)["containers"][0]
    for probe in PROBES:
        service = container[probe]["grpc"].get("service", "")
        assert await health_of(target, service) == SERVING, (dc.name_of(workload), probe)


@contextlib.asynccontextmanager
async def inference_pod(pod: pods.Pod, monkeypatch: pytest.MonkeyPatch):
    from mlpair.inference.server import InferenceServer
    from mlpair.inference.settings import InferenceSettings

    settings = settings_for(
        InferenceSettings,
        pod,
        monkeypatch,
        host="127.0.0.1",
        port="0",
        metrics_port="0",
        otlp_endpoint="",
    )
    server = InferenceServer(settings)
    await server.start()
    try:
        await server.load()
        yield f"127.0.0.1:{server.port}", server
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def prediction_pod(pod: pods.Pod, monkeypatch: pytest.MonkeyPatch, **local: str):
    from mlpair.prediction.server import stop
    from tests.support import start_prediction
    from mlpair.prediction.settings import PredictionSettings

    settings = settings_for(
        PredictionSettings,
        pod,
        monkeypatch,
        host="127.0.0.1",
        port="0",
        metrics_port="0",
        otlp_endpoint="",
        **local,
    )
    server, port, health, predictor = await start_prediction(settings)
    try:
        yield f"127.0.0.1:{port}", predictor
    finally:
        await stop(server, health, predictor, 1.0)


def shadow_count(family: str, primary: str, shadow: str) -> float:
    labels = {"model": family, "primary_version": primary, "shadow_version": shadow}
    return sum(
        REGISTRY.get_sample_value("prediction_shadow_decisions_total", {**labels, "agreement": a})
        or 0.0
        for a in ("agree", "disagree")
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("overlay", dc.OVERLAYS)
async def test_rendered_pods_start_answer_their_probes_and_decide(
    rendered: dict,
    overlay: str,
    release_repository: Path,
    credit_holdout,
    churn_holdout,
    postgres_url: str,
    redis_prefix: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    objects = rendered[overlay]
    records = {
        "credit-risk": (credit_holdout.entity_ids[0], credit_holdout.records[0]),
        "churn": (churn_holdout.entity_ids[0], churn_holdout.records[0]),
    }
    (inference,) = dc.workloads(objects, "inference")
    inference_fs = pods.materialise(inference, objects, tmp_path / "inference", release_repository)
    monkeypatch.chdir(inference_fs.root)  # a relative path would land in the pod's root
    async with inference_pod(inference_fs, monkeypatch) as (inference_target, server):
        await assert_probes_pass(inference, inference_target)
        release = {(f, v) for f, v in dc.mounted_versions(inference, "/models")[0]}
        serving = {(f, v) for f, vs in server.engine.repository.serving().items() for v in vs}
        assert serving == release  # every mounted version, nothing else

        for workload in dc.workloads(objects, "prediction"):
            name = workload["metadata"]["name"]
            pod = pods.materialise(workload, objects, tmp_path / name, release_repository)
            monkeypatch.chdir(pod.root)
            settings = dc.settings_of(workload, objects)
            deciding = dc.json_setting(settings, "PREDICTION_ENSEMBLES", {})
            shadows = dc.json_setting(settings, "PREDICTION_SHADOWS", {})
            before = {f: shadow_count(f, deciding[f][0], v) for f, v in shadows.items()}
            async with prediction_pod(
                pod,
                monkeypatch,
                inference_target=inference_target,
                crm_url=postgres_url,
                redis_url="redis://127.0.0.1:6379/0",
                redis_key_prefix=redis_prefix,
            ) as (target, predictor):
                await assert_probes_pass(workload, target)
                async with grpc.aio.insecure_channel(target) as channel:
                    stub = pb_grpc.PredictionServiceStub(channel)
                    for family, (entity_id, record) in records.items():
                        reply = await stub.Predict(
                            pb.PredictRequest(
                                request_id=f"{redis_prefix}{name}-{family}",
                                entity_id=entity_id,
                                attributes=to_attributes(record),
                                model_name=family,
                            ),
                            timeout=5,
                        )
                        # A real decision (never the fallback) by the version the track names.
                        assert not reply.fallback, (name, family, reply.degraded_reason)
                        assert [reply.model_version] == deciding[family], (name, family)
                await predictor.drain_background()
                assert await predictor.recorder.wait_delivered(10)
            for family, version in shadows.items():
                assert shadow_count(family, deciding[family][0], version) == before[family] + 1
            outbox = dc.sqlite_path(settings["PREDICTION_OUTBOX_URL"])
            assert pod.path(outbox).is_file(), name
            assert pod.written_outside_writable_mounts() == [], name
    assert inference_fs.written_outside_writable_mounts() == []
