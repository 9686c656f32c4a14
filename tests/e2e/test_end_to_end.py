"""Both real servers on free ports: real applicants scored end to end over gRPC."""

from __future__ import annotations

import asyncio
import json
import shutil

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.contracts.assembly import FeatureAssembler
from mlpair.contracts.calibration import temperature_probability
from mlpair.contracts.manifest import ModelEntry
from mlpair.prediction.converters import to_attributes
from mlpair.prediction.errors import InferenceContractError
from mlpair.prediction.pipeline import ConfigurationError, ModelFamily, PredictInput
from mlpair.prediction.server import build_predictor
from mlpair.prediction.settings import PredictionSettings
from tests.support import CONFIG_DIR

N_APPLICANTS = 60


@pytest.fixture(scope="module")
async def prediction(inference_server, model_repository, tmp_path_factory):
    """A real PredictionService in front of the session's InferenceService, with a SQLite CRM."""
    from mlpair.prediction.server import start, stop

    state = tmp_path_factory.mktemp("crm")
    settings = PredictionSettings(host="127.0.0.1", port=0, metrics_port=0, inference_target=inference_server,
                                  crm_url=f"sqlite+aiosqlite:///{state / 'crm.sqlite'}",
                                  outbox_url=f"sqlite+aiosqlite:///{state / 'outbox.sqlite'}",
                                  model_repository=model_repository, config_dir=CONFIG_DIR)
    server, port, health, predictor = await start(settings)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.PredictionServiceStub(channel), predictor
    await stop(server, health, predictor, 0)


def predict_request(request_id: str, entity_id: str, attributes: dict) -> pb.PredictRequest:
    return pb.PredictRequest(request_id=request_id, entity_id=entity_id, attributes=to_attributes(attributes))


def expected_probabilities(entry: ModelEntry, records: list[dict]) -> np.ndarray:
    x = FeatureAssembler(entry.preprocessing).assemble_many(records)
    logits = ort.InferenceSession(str(entry.model_path), providers=["CPUExecutionProvider"]).run(None, {"features": x})[0]
    return temperature_probability(logits, entry.manifest.calibration.temperature, entry.manifest.positive_index)


async def test_real_applicants_are_scored_and_recorded_once(prediction, credit_holdout, credit_entry):
    stub, predictor = prediction
    ids = credit_holdout.entity_ids[:N_APPLICANTS]
    records = credit_holdout.records[:N_APPLICANTS]
    before = await predictor.crm.count()
    replies = await asyncio.gather(*(stub.Predict(predict_request(f"e2e-{eid}", eid, rec))
                                     for eid, rec in zip(ids, records)))
    expected = expected_probabilities(credit_entry, records)
    for reply, eid, p in zip(replies, ids, expected):
        assert reply.request_id == f"e2e-{eid}" and reply.decision_id
        assert reply.probability == pytest.approx(p, abs=1e-6)
        assert reply.decision != pb.DECISION_UNSPECIFIED and reply.reason_codes
        assert reply.model_version == credit_entry.manifest.model_version
        assert reply.feature_schema_version == "credit-risk/v1"
        assert reply.policy_version == "credit-risk-policy/v1"
        assert not reply.from_cache
    assert await predictor.recorder.wait_delivered(10)
    assert await predictor.crm.count() == before + N_APPLICANTS


async def test_retry_with_the_same_request_id_returns_the_recorded_decision(prediction, credit_holdout):
    stub, predictor = prediction
    req = predict_request("retry-1", credit_holdout.entity_ids[0], credit_holdout.records[0])
    first = await stub.Predict(req)
    assert await predictor.recorder.wait_delivered(10)
    count = await predictor.crm.count()
    second = await stub.Predict(req)
    assert second.decision_id == first.decision_id and second.probability == first.probability
    assert await predictor.recorder.wait_delivered(10)
    assert await predictor.crm.count() == count


async def test_guards_fire_and_a_decision_is_still_returned(prediction, credit_holdout):
    stub, _ = prediction
    record = {**credit_holdout.records[0], "Income": 99999999, "Assets": -1, "Home": "houseboat", "Extra": "x"}
    reply = await stub.Predict(predict_request("guards-1", "g1", record))
    assert {"INCOME_SENTINEL_DEFAULTED", "ASSETS_SENTINEL_DEFAULTED", "HOME_UNKNOWN_CATEGORY"} <= set(reply.reason_codes)
    assert reply.decision != pb.DECISION_UNSPECIFIED


@pytest.mark.parametrize("request_id,entity_id,attributes", [
    ("", "e", {}), ("r-bad-entity", "", {}), ("x" * 129, "e", {}),
    ("r-bad-types", "e", {"Age": "thirty", "Home": 4.0}),
])
async def test_bad_requests_are_refused_and_nothing_is_recorded(prediction, request_id, entity_id, attributes):
    stub, predictor = prediction
    assert await predictor.recorder.wait_delivered(10)
    count = await predictor.crm.count()
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await stub.Predict(predict_request(request_id, entity_id, attributes))
    assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Traceback" not in excinfo.value.details()
    assert await predictor.recorder.wait_delivered(10)
    assert await predictor.crm.count() == count


async def test_unknown_model_family_is_not_found(prediction):
    stub, _ = prediction
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await stub.Predict(pb.PredictRequest(request_id="m1", entity_id="e", model_name="churn"))
    assert excinfo.value.code() == grpc.StatusCode.NOT_FOUND


def _repo_on_schema_version(entry: ModelEntry, root, config_dir, version: str):
    """A copy of the model entry and config whose feature schema claims another version."""
    from mlpair.contracts.manifest import MANIFEST_FILE, PREPROCESSING_FILE
    from mlpair.contracts.schema import Preprocessing

    target = root / "credit-risk" / entry.manifest.model_version
    shutil.copytree(entry.path, target)
    data = json.loads((target / PREPROCESSING_FILE).read_text())
    data["feature_schema"]["version"] = version
    prep = Preprocessing.model_validate(data)
    prep.save(target / PREPROCESSING_FILE)
    manifest = json.loads((target / MANIFEST_FILE).read_text())
    manifest["versions"].update(feature_schema_version=version, preprocessing_hash=prep.hash)
    (target / MANIFEST_FILE).write_text(json.dumps(manifest))
    shutil.copytree(CONFIG_DIR / "credit-risk", config_dir / "credit-risk")
    schema_file = config_dir / "credit-risk" / "feature-schema.toml"
    schema_file.write_text(schema_file.read_text().replace('version = "credit-risk/v1"', f'version = "{version}"'))


async def test_c31_schema_version_mismatch_is_refused_and_not_decided(inference_server, credit_entry, credit_holdout, tmp_path):
    _repo_on_schema_version(credit_entry, tmp_path / "models", tmp_path / "config", "credit-risk/v2")
    settings = PredictionSettings(inference_target=inference_server, config_dir=tmp_path / "config",
                                  model_repository=tmp_path / "models",
                                  crm_url=f"sqlite+aiosqlite:///{tmp_path / 'crm.sqlite'}",
                                  outbox_url=f"sqlite+aiosqlite:///{tmp_path / 'outbox.sqlite'}")
    predictor = build_predictor(settings)
    await predictor.recorder.start()
    try:
        with pytest.raises(InferenceContractError):
            await predictor.predict(PredictInput("c31-1", "e1", credit_holdout.records[0]))
        assert await predictor.recorder.outbox.backlog() == (0, 0.0)
        assert await predictor.recorder.wait_delivered(10) and await predictor.crm.count() == 0
    finally:
        await predictor.scorer.close()
        await predictor.inference.close()
        await predictor.recorder.close()


def test_configured_schema_must_be_the_trained_one(credit_entry, model_repository, tmp_path):
    shutil.copytree(CONFIG_DIR / "credit-risk", tmp_path / "credit-risk")
    schema_file = tmp_path / "credit-risk" / "feature-schema.toml"
    schema_file.write_text(schema_file.read_text().replace("max = 5000", "max = 6000"))
    with pytest.raises(ConfigurationError, match="differs"):
        ModelFamily.load("credit-risk", tmp_path, model_repository)
