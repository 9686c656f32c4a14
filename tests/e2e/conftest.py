"""Fixtures for end-to-end tests: real InferenceService and PredictionService pairs on free ports."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from pathlib import Path

import grpc
import pytest

from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.training.pipeline import load_train_config, train_family
from tests.support import CONFIG_DIR, CREDIT_SCHEMA

INFERENCE_MAX_BATCH = 64  # as the session's inference_server; PredictionService packs to it
ENSEMBLE_SEEDS = (7, 11)  # versions 2 and 3 of credit-risk; version 1 is the session's model


@contextlib.asynccontextmanager
async def prediction_service(inference_target: str, model_repository: Path, crm_dir: Path, **overrides):
    """A real PredictionService (SQLite CRM) in front of ``inference_target``; yields (stub, predictor)."""
    async with (
        prediction_server(inference_target, model_repository, crm_dir, **overrides) as (target, predictor),
        grpc.aio.insecure_channel(target) as channel,
    ):
        yield pb_grpc.PredictionServiceStub(channel), predictor


@contextlib.asynccontextmanager
async def prediction_server(inference_target: str, model_repository: Path, crm_dir: Path, **overrides):
    """As :func:`prediction_service`, for callers with their own channel; yields (host:port, predictor)."""
    from mlpair.prediction.server import stop
    from mlpair.prediction.settings import PredictionSettings
    from tests.support import start_prediction

    settings = PredictionSettings(**{
        "host": "127.0.0.1", "port": 0, "metrics_port": 0, "inference_target": inference_target,
        "crm_url": f"sqlite+aiosqlite:///{crm_dir / 'crm.sqlite'}",
        "ledger_url": f"sqlite+aiosqlite:///{crm_dir / 'ledger.sqlite'}", "model_repository": model_repository,
        "config_dir": CONFIG_DIR, "models": ["credit-risk", "churn"],
        "inference_max_batch_rows": INFERENCE_MAX_BATCH,
        # a shared, loaded 2-core machine: no spurious deadlines or open circuits outside the fault tests
        "inference_timeout_ms": 10_000, **overrides})
    server, port, health, predictor = await start_prediction(settings)
    try:
        yield f"127.0.0.1:{port}", predictor
    finally:
        await stop(server, health, predictor, 0)


async def crm_count(predictor) -> int:
    """CRM rows once the relay has delivered every decision recorded so far."""
    assert await predictor.recorder.wait_delivered(10)
    return await predictor.crm.count()


@contextlib.asynccontextmanager
async def inference_service(model_repository: Path, *, all_versions: bool = False, **overrides):
    """A real InferenceService on a free port; ``all_versions`` serves every version of each model."""
    from mlpair.inference.server import InferenceServer
    from mlpair.inference.settings import InferenceSettings

    settings = InferenceSettings(**{"host": "127.0.0.1", "port": 0, "metrics_port": 0,
                                    "model_repository": model_repository, "max_batch_size": INFERENCE_MAX_BATCH,
                                    "version_policy": "all" if all_versions else "latest:1", **overrides})
    server = InferenceServer(settings)
    await server.start()
    try:
        await server.load()
        yield f"127.0.0.1:{server.port}"
    finally:
        await server.stop()


@pytest.fixture(scope="package")
async def replicas(nonfinite_repository, postgres_url, tmp_path_factory):
    """Real processes over one InferenceService, one decision ledger and one CRM in PostgreSQL:
    two healthy PredictionService replicas (each with its metrics port) and a third whose
    InferenceService is unreachable (it can only fall back); the cache is off, so every answer
    comes from an Infer call. The model entry gives NaN logits for applicants of 95+
    (``tests.nonfinite``), the real model's for everyone else. Shared by C40–C42 and C43."""
    from tests.e2e.replicas import cluster
    from tests.support.pair import free_port

    async with cluster(tmp_path_factory.mktemp("replicas"), nonfinite_repository, postgres_url, replicas=2,
                       PREDICTION_CACHE_BACKEND="off", PREDICTION_METRICS_PORT=str(free_port()),
                       extra={"cut-off": {"PREDICTION_INFERENCE_TARGET": f"127.0.0.1:{free_port()}",
                                          "PREDICTION_METRICS_PORT": "0"}}) as c:
        yield c


@pytest.fixture(scope="session")
def ensemble_repository(credit_entry, tmp_path_factory) -> Path:
    """credit-risk versions 1 (the session's model), 2 and 3 (other seeds, same split and features)."""
    root = tmp_path_factory.mktemp("ensemble")
    shutil.copytree(credit_entry.path, root / "credit-risk" / "1")
    base = load_train_config(CREDIT_SCHEMA)
    for seed in ENSEMBLE_SEEDS:
        train_family(CREDIT_SCHEMA, root, dataclasses.replace(base, seed=seed), force=True, show_progress=False)
    return root


@pytest.fixture(scope="module")
async def inference(nonfinite_repository):
    async with inference_service(nonfinite_repository) as target:
        yield target


@pytest.fixture(scope="module")
async def prediction(inference, nonfinite_repository, tmp_path_factory):
    async with prediction_service(inference, nonfinite_repository, tmp_path_factory.mktemp("isolation"),
                                  cache_backend="off") as served:
        yield served
