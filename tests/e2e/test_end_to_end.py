"""Both real servers on free ports: real credit applicants and telecom customers scored over gRPC
by one PredictionService serving both model families with the same code."""

from __future__ import annotations

import asyncio
import json
import shutil

import grpc
import pytest

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.contracts.manifest import ModelEntry
from mlpair.prediction.composition import build_components
from mlpair.prediction.deciding.policy import DecisionPolicy
from mlpair.prediction.errors import InferenceContractError
from mlpair.prediction.pipeline import ConfigurationError, ModelFamily, PredictInput
from mlpair.prediction.settings import PredictionSettings
from tests.e2e.conftest import crm_count, prediction_service
from tests.support import CONFIG_DIR, defaulted, migrate_for
from tests.support.e2e import expected_probabilities

N_ENTITIES = 60


@pytest.fixture(scope="module")
async def prediction(inference_server, model_repository, tmp_path_factory):
    """A real PredictionService serving credit-risk (default) and churn, with a SQLite CRM."""
    async with prediction_service(inference_server, model_repository, tmp_path_factory.mktemp("crm")) as served:
        yield served


@pytest.fixture(scope="module")
def families(credit_entry, credit_holdout, churn_entry, churn_holdout):
    return {"credit-risk": (credit_entry, credit_holdout), "churn": (churn_entry, churn_holdout)}


def predict_request(request_id: str, entity_id: str, attributes: dict, model_name: str = "", **kw) -> pb.PredictRequest:
    return pb.PredictRequest(request_id=request_id, entity_id=entity_id, attributes=to_attributes(attributes),
                             model_name=model_name, **kw)


@pytest.mark.parametrize("family", ["credit-risk", "churn"])
async def test_real_entities_are_scored_and_recorded_once(prediction, families, family):
    stub, predictor = prediction
    entry, holdout = families[family]
    policy = DecisionPolicy.from_toml(CONFIG_DIR / family / "policy.toml")
    ids, records = holdout.entity_ids[:N_ENTITIES], holdout.records[:N_ENTITIES]
    before = await crm_count(predictor)
    replies = await asyncio.gather(*(stub.Predict(predict_request(f"e2e-{family}-{eid}", eid, rec, family))
                                     for eid, rec in zip(ids, records)))
    expected = expected_probabilities(entry, records)
    for reply, eid, p, record in zip(replies, ids, expected, records):
        assert reply.request_id == f"e2e-{family}-{eid}" and reply.decision_id
        assert reply.probability == pytest.approx(p, abs=1e-6)
        verdict = policy.decide(reply.probability, missing=defaulted(entry, record))  # a required attribute missing: REVIEW
        assert reply.decision_label == verdict.decision and reply.reason_codes[0] == verdict.reason_codes[0]
        assert reply.model_version == entry.manifest.model_version
        assert reply.feature_schema_version == f"{family}/v1"
        assert reply.policy_version == policy.version
        assert reply.calibration_method == entry.manifest.calibration.method
        assert reply.spread == 0.0 and not reply.contributions and not reply.from_cache
    assert await crm_count(predictor) == before + N_ENTITIES


async def test_decision_labels_of_each_family(prediction, families):
    """Credit labels also fill the wire enum; churn's own labels travel as decision_label only."""
    stub, _ = prediction
    labels = {}
    for family, (_, holdout) in families.items():
        replies = await asyncio.gather(*(stub.Predict(predict_request(f"labels-{family}-{i}", eid, rec, family))
                                         for i, (eid, rec) in enumerate(zip(holdout.entity_ids[:200], holdout.records))))
        labels[family] = {(r.decision_label, r.decision) for r in replies}
    assert {label for label, _ in labels["credit-risk"]} == {"APPROVE", "REVIEW", "DECLINE"}
    assert all(enum == pb.Decision.Value(f"DECISION_{label}") for label, enum in labels["credit-risk"])
    assert {label for label, _ in labels["churn"]} == {"NO_ACTION", "RETAIN_OFFER"}
    assert all(enum == pb.DECISION_UNSPECIFIED for _, enum in labels["churn"])


async def test_empty_model_name_uses_the_default_family(prediction, credit_holdout):
    stub, _ = prediction
    reply = await stub.Predict(predict_request("default-1", "d1", credit_holdout.records[0]))
    assert reply.feature_schema_version == "credit-risk/v1"


async def test_retry_with_the_same_request_id_returns_the_recorded_decision(prediction, credit_holdout):
    stub, predictor = prediction
    req = predict_request("retry-1", credit_holdout.entity_ids[0], credit_holdout.records[0])
    first = await stub.Predict(req)
    count = await crm_count(predictor)
    second = await stub.Predict(req)
    assert second.decision_id == first.decision_id and second.probability == first.probability
    assert second.decision_label == first.decision_label and second.policy_version == first.policy_version
    assert await crm_count(predictor) == count


async def test_crm_row_stores_the_policy_version_and_decision_label(prediction, churn_holdout):
    stub, predictor = prediction
    reply = await stub.Predict(predict_request("crm-row-1", "c1", churn_holdout.records[0], "churn"))
    assert await predictor.recorder.wait_delivered(10)
    row = await predictor.crm.find("crm-row-1")
    assert (row.policy_version, row.decision, row.model_name) == ("churn-policy/v2", reply.decision_label, "churn")


async def test_c28_c32_guards_fire_and_a_decision_is_still_returned(prediction, credit_holdout, churn_holdout):
    stub, _ = prediction
    record = {**credit_holdout.records[0], "Income": 99999999, "Assets": -1, "Home": "houseboat", "Extra": "x"}
    reply = await stub.Predict(predict_request("guards-1", "g1", record))
    assert {"INCOME_SENTINEL_DEFAULTED", "ASSETS_SENTINEL_DEFAULTED", "HOME_UNKNOWN_CATEGORY"} <= set(reply.reason_codes)
    assert reply.decision_label in ("APPROVE", "REVIEW", "DECLINE")
    record = {**churn_holdout.records[0], "monthly_charges": -1, "contract": "Three year", "partner": True}
    reply = await stub.Predict(predict_request("guards-2", "g2", record, "churn"))
    assert {"MONTHLY_CHARGES_SENTINEL_DEFAULTED", "CONTRACT_UNKNOWN_CATEGORY"} <= set(reply.reason_codes)
    assert reply.decision_label in ("NO_ACTION", "RETAIN_OFFER")


async def test_c28_guard_counter_per_feature_and_action(prediction, credit_holdout):
    from prometheus_client import REGISTRY

    stub, _ = prediction
    labels = {"model": "credit-risk", "feature": "Income", "action": "SENTINEL_DEFAULTED"}
    before = REGISTRY.get_sample_value("prediction_feature_guard_total", labels) or 0.0
    await stub.Predict(predict_request("guard-count-1", "g", {**credit_holdout.records[1], "Income": 99999999}))
    assert REGISTRY.get_sample_value("prediction_feature_guard_total", labels) == before + 1


async def test_c31_unknown_attributes_are_ignored_and_counted(prediction, churn_holdout):
    from prometheus_client import REGISTRY

    stub, _ = prediction
    before = REGISTRY.get_sample_value("prediction_unknown_attributes_total", {"model": "churn"}) or 0.0
    source = churn_holdout.records[2]  # the source row carries `female`, which the schema leaves out
    record = {**source, "female": 1 - source["female"], "shoe_size": 44}
    plain = await stub.Predict(predict_request("unknown-attr-0", "u", source, "churn"))
    extra = await stub.Predict(predict_request("unknown-attr-1", "u", record, "churn"))
    assert extra.probability == plain.probability  # ignored: the same vector
    assert REGISTRY.get_sample_value("prediction_unknown_attributes_total", {"model": "churn"}) == before + 1 + 2


@pytest.mark.parametrize("request_id,entity_id,attributes,model_name", [
    ("", "e", {}, ""), ("r-bad-entity", "", {}, ""), ("x" * 129, "e", {}, ""),
    ("r-bad-types", "e", {"Age": "thirty", "Home": 4.0}, ""),
    ("r-bad-churn", "e", {"tenure": 1.5, "partner": "maybe"}, "churn"),
])
async def test_bad_requests_are_refused_and_nothing_is_recorded(prediction, request_id, entity_id, attributes, model_name):
    stub, predictor = prediction
    count = await crm_count(predictor)
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await stub.Predict(predict_request(request_id, entity_id, attributes, model_name))
    assert excinfo.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Traceback" not in excinfo.value.details()
    assert await crm_count(predictor) == count


async def test_unknown_model_family_is_not_found(prediction):
    stub, _ = prediction
    with pytest.raises(grpc.aio.AioRpcError) as excinfo:
        await stub.Predict(pb.PredictRequest(request_id="m1", entity_id="e", model_name="fraud"))
    assert excinfo.value.code() == grpc.StatusCode.NOT_FOUND
    assert "churn" in excinfo.value.details() and "credit-risk" in excinfo.value.details()


def _repo_on_schema_version(entry: ModelEntry, root, config_dir, version: str):
    """A copy of the model entry and config whose feature schema claims another version."""
    from mlpair.contracts.manifest import MANIFEST_FILE, PREPROCESSING_FILE
    from mlpair.contracts.preprocessing import Preprocessing

    name, old = entry.manifest.model_name, entry.manifest.versions.feature_schema_version
    target = root / name / entry.manifest.model_version
    shutil.copytree(entry.path, target)
    data = json.loads((target / PREPROCESSING_FILE).read_text())
    data["feature_schema"]["version"] = version
    prep = Preprocessing.model_validate(data)
    prep.save(target / PREPROCESSING_FILE)
    manifest = json.loads((target / MANIFEST_FILE).read_text())
    manifest["versions"].update(feature_schema_version=version, preprocessing_hash=prep.hash)
    (target / MANIFEST_FILE).write_text(json.dumps(manifest))
    shutil.copytree(CONFIG_DIR / name, config_dir / name)
    schema_file = config_dir / name / "feature-schema.toml"
    schema_file.write_text(schema_file.read_text().replace(f'version = "{old}"', f'version = "{version}"'))


@pytest.mark.parametrize("family", ["credit-risk", "churn"])
async def test_c31_schema_version_mismatch_is_refused_and_not_decided(inference_server, families, family, tmp_path):
    entry, holdout = families[family]
    _repo_on_schema_version(entry, tmp_path / "models", tmp_path / "config", f"{family}/v2")
    settings = PredictionSettings(inference_target=inference_server, config_dir=tmp_path / "config",
                                  model_repository=tmp_path / "models", models=[family], model_name=family,
                                  crm_url=f"sqlite+aiosqlite:///{tmp_path / 'crm.sqlite'}",
                                  ledger_url=f"sqlite+aiosqlite:///{tmp_path / 'ledger.sqlite'}")
    components = build_components(settings)
    await migrate_for(settings)
    await components.start()
    try:
        with pytest.raises(InferenceContractError):
            await components.predictor.predict(PredictInput("c31-1", "e1", holdout.records[0]))
        [outcome] = await components.predictor.predict_batch([PredictInput("c31-2", "e2", holdout.records[1])])
        assert isinstance(outcome, InferenceContractError)
        assert await components.recorder.ledger.backlog() == (0, 0.0)
        assert await crm_count(components) == 0
    finally:
        await components.close()


@pytest.mark.parametrize("family", ["credit-risk", "churn"])
def test_configured_schema_must_be_the_trained_one(model_repository, family, tmp_path):
    shutil.copytree(CONFIG_DIR / family, tmp_path / family)
    schema_file = tmp_path / family / "feature-schema.toml"
    schema_file.write_text(schema_file.read_text().replace("max = 500\n", "max = 600\n").replace("max = 5000\n", "max = 6000\n"))
    with pytest.raises(ConfigurationError, match="differs"):
        ModelFamily.load(family, tmp_path, model_repository)


def test_the_service_refuses_to_start_when_the_default_family_is_not_served(model_repository):
    from mlpair.prediction.settings import PredictionSettings

    settings = PredictionSettings(model_repository=model_repository, config_dir=CONFIG_DIR, models=["churn"],
                                  model_name="credit-risk")
    with pytest.raises(ConfigurationError, match="default"):
        build_components(settings)


@pytest.mark.parametrize("family", ["credit-risk", "churn"])
async def test_an_empty_record_is_never_decided_automatically(prediction, family):
    """Every feature defaulted: the training averages would decide, so a person does."""
    stub, _ = prediction
    reply = await stub.Predict(predict_request(f"empty-{family}", "e-empty", {}, family))
    assert reply.decision_label == "REVIEW" and reply.reason_codes[0] == "INSUFFICIENT_DATA"
    assert all(code.endswith("_MISSING_DEFAULTED") for code in reply.reason_codes[2:])
