"""Fixtures shared by the whole suite: one real model trained once per session on real data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mlpair.contracts.assembly import FeatureAssembler
from mlpair.contracts.manifest import ModelEntry
from mlpair.contracts.schema import FeatureSchema
from mlpair.training.data import Dataset, load_dataset, stratified_split
from mlpair.training.pipeline import train_family
from tests.support import CHURN_SCHEMA, CREDIT_SCHEMA


@pytest.fixture(scope="session", autouse=True)
def one_serving_process_per_service():
    """Services the tests start as processes (``mlpair serve``) run as one process each, as before
    ``workers`` existed, so that a PID, a kill -9 or a timing means one process; tests of several
    workers (tests/e2e/test_workers.py) set ``*_WORKERS`` themselves."""
    mp = pytest.MonkeyPatch()
    mp.setenv("INFERENCE_WORKERS", "1")
    mp.setenv("PREDICTION_WORKERS", "1")
    yield
    mp.undo()


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory) -> Path:
    """A model repository holding credit-risk and churn version 1, trained on the real data."""
    root = tmp_path_factory.mktemp("models")
    train_family(CREDIT_SCHEMA, root, show_progress=False)
    train_family(CHURN_SCHEMA, root, show_progress=False)
    return root


@pytest.fixture(scope="session")
def credit_entry(model_repository) -> ModelEntry:
    from mlpair.contracts.manifest import load_latest

    return load_latest(model_repository, "credit-risk")


@pytest.fixture(scope="session")
def nonfinite_repository(credit_entry, churn_entry, tmp_path_factory) -> Path:
    """credit-risk whose logits are NaN for applicants of 95+ (``tests.nonfinite``), and the real churn model."""
    from tests import nonfinite

    return nonfinite.repository(credit_entry, churn_entry, tmp_path_factory.mktemp("nonfinite"))


@pytest.fixture(scope="session")
def credit_schema() -> FeatureSchema:
    return FeatureSchema.from_toml(CREDIT_SCHEMA)


@pytest.fixture(scope="session")
def credit_data(credit_schema) -> Dataset:
    return load_dataset(credit_schema)


@pytest.fixture(scope="session")
def credit_holdout(credit_data, credit_entry) -> Dataset:
    """The real holdout applicants the model never saw (same split as training)."""
    seed = int(credit_entry.manifest.data_source["split"]["seed"])
    return credit_data.subset(stratified_split(credit_data.labels, seed)["holdout"])


@pytest.fixture(scope="session")
def holdout_x(credit_entry, credit_holdout) -> np.ndarray:
    """Every real holdout applicant as model input, ``[n, n_features] float32``."""
    return FeatureAssembler(credit_entry.preprocessing).assemble_many(credit_holdout.records)


@pytest.fixture(scope="session")
def feature_version(credit_entry) -> str:
    return credit_entry.manifest.versions.feature_schema_version


@pytest.fixture(scope="session")
def good_metadata(feature_version):
    return (("x-feature-version", feature_version),)


@pytest.fixture(scope="session")
def churn_entry(model_repository) -> ModelEntry:
    from mlpair.contracts.manifest import load_latest

    return load_latest(model_repository, "churn")


@pytest.fixture(scope="session")
def churn_schema() -> FeatureSchema:
    return FeatureSchema.from_toml(CHURN_SCHEMA)


@pytest.fixture(scope="session")
def churn_data(churn_schema) -> Dataset:
    return load_dataset(churn_schema)


@pytest.fixture(scope="session")
def churn_holdout(churn_data, churn_entry) -> Dataset:
    """The real holdout customers the churn model never saw (same split as training)."""
    seed = int(churn_entry.manifest.data_source["split"]["seed"])
    return churn_data.subset(stratified_split(churn_data.labels, seed)["holdout"])


@pytest.fixture(scope="session")
async def inference_server(model_repository):
    """A real InferenceService on a free port, serving the session's models (both families)."""
    from mlpair.inference.server import start
    from mlpair.inference.settings import InferenceSettings

    settings = InferenceSettings(host="127.0.0.1", port=0, metrics_port=0, model_repository=model_repository,
                                 max_batch_size=64)
    server, port, _, engine = await start(settings)
    yield f"127.0.0.1:{port}"
    await server.stop(0)
    await engine.close()


@pytest.fixture(scope="session")
async def inference_stub(inference_server):
    import grpc

    from mlpair.api.inference.v1 import inference_service_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(inference_server) as channel:
        yield pb_grpc.InferenceServiceStub(channel)


@pytest.fixture(scope="session")
def postgres_url():
    """SQLAlchemy URL of a fresh PostgreSQL database for this session, dropped afterwards.

    A sync fixture (it runs its own short event loop), so parametrised fixtures can request it.
    Skips when PostgreSQL is down (fails under CI=true): see ``require_service``.
    """
    from tests.support import POSTGRES_HOST, POSTGRES_PORT, require_service
    from tests.support.pair import scratch_postgres

    require_service("PostgreSQL", POSTGRES_HOST, POSTGRES_PORT)
    with scratch_postgres(prefix="mlpair_test") as url:
        yield url
