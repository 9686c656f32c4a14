"""PredictionService's families from S3 (a real moto server): the same preprocessing and calibration
as from the folder, ensemble members fetched too, and an unreachable source at start retried with
backoff (counted) until it answers."""

from __future__ import annotations

import threading
import time

import boto3
import pytest
from prometheus_client import REGISTRY

from mlpair.prediction.composition import load_families
from mlpair.prediction.settings import PredictionSettings
from mlpair.sources.publish import publish
from tests.inference.helpers import copy_version
from tests.support.pair import free_port
from tests.support.stores import moto_s3, s3_env


def settings_for(tmp_path, uri: str, **kw) -> PredictionSettings:
    return PredictionSettings(host="127.0.0.1", port=0, metrics_port=0, models=["credit-risk", "churn"],
                              model_source=uri, model_cache_dir=tmp_path / "cache", model_repository=tmp_path / "none",
                              **kw)


def test_families_load_from_s3_as_from_the_folder(model_repository, bucket, tmp_path):
    uri = f"s3://{bucket}/prod"
    for name in ("credit-risk", "churn"):
        publish(model_repository / name / "1", uri)
    publish(copy_version(model_repository / "credit-risk" / "1", tmp_path / "build", "2"), uri)
    remote = load_families(settings_for(tmp_path, uri, ensembles={"credit-risk": ["1", "2"]}))
    local = load_families(PredictionSettings(models=["credit-risk", "churn"], model_repository=model_repository))
    assert [m.version for m in remote["credit-risk"].members] == ["1", "2"]
    assert remote["credit-risk"].entry.manifest.model_version == "2"
    for name in ("credit-risk", "churn"):
        assert remote[name].entry.preprocessing == local[name].entry.preprocessing
        assert remote[name].entry.manifest.calibration == local[name].entry.manifest.calibration
        assert remote[name].entry.path.resolve().is_relative_to((tmp_path / "cache").resolve())


@pytest.mark.timeout(60)
def test_unreachable_at_start_is_retried_until_it_answers(model_repository, tmp_path, monkeypatch, caplog):
    port = free_port()
    for key, value in s3_env(f"http://127.0.0.1:{port}").items():
        monkeypatch.setenv(key, value)
    before = REGISTRY.get_sample_value("prediction_model_source_errors_total") or 0.0
    found: dict = {}
    loader = threading.Thread(target=lambda: found.update(
        load_families(settings_for(tmp_path, "s3://late/prod", source_retry_max_s=4.0))))
    loader.start()
    deadline = time.monotonic() + 10
    while REGISTRY.get_sample_value("prediction_model_source_errors_total") - before < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    # tries at 0, 0.5, 1.5 and 3.5 s failed; the next comes 4 s later, when the bucket is filled
    assert REGISTRY.get_sample_value("prediction_model_source_errors_total") - before == 4
    assert loader.is_alive() and found == {}
    assert "not ready: model source s3://late/prod: listing credit-risk failed (EndpointConnectionError)" in caplog.text
    with moto_s3(tmp_path / "moto.log", port=port):
        boto3.client("s3").create_bucket(Bucket="late")
        for name in ("credit-risk", "churn"):
            publish(model_repository / name / "1", "s3://late/prod")
        loader.join(30)
    assert sorted(found) == ["churn", "credit-risk"]
