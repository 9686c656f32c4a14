"""Fixtures of the model-source tests: a real moto S3 server for the session, a bucket per test,
the AWS environment pointing at it (with a secret that must never be printed)."""

from __future__ import annotations

import uuid

import pytest

from tests.support.stores import moto_s3, s3_env


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    with moto_s3(tmp_path_factory.mktemp("moto") / "moto.log") as endpoint:
        yield endpoint


@pytest.fixture
def bucket(s3_endpoint, monkeypatch) -> str:
    """A new, empty bucket; boto3 reads the endpoint and credentials from the environment."""
    import boto3

    for key, value in s3_env(s3_endpoint).items():
        monkeypatch.setenv(key, value)
    name = f"models-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def mlflow_url(tmp_path_factory):
    from tests.support.stores import mlflow_server

    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as url:
        yield url


@pytest.fixture
def registry(mlflow_url, monkeypatch) -> str:
    """MLflow's client pointed at the session's real server (MLFLOW_TRACKING_URI); yields its URL."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_url)
    return mlflow_url
