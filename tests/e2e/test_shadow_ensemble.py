"""Shadow comparison and ensemble uncertainty with three real credit-risk versions (three seeds)."""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import onnxruntime as ort
import pytest
from prometheus_client import REGISTRY

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.contracts.assembly import FeatureAssembler
from mlpair.contracts.manifest import load_entry
from mlpair.prediction.deciding.policy import DecisionPolicy
from mlpair.prediction.families import ConfigurationError, ModelFamily
from tests.e2e.conftest import inference_service, prediction_service
from tests.support import CONFIG_DIR

N = 80


@pytest.fixture(scope="module")
async def all_versions(ensemble_repository):
    """InferenceService serving versions 1, 2 and 3 of credit-risk side by side."""
    async with inference_service(ensemble_repository, all_versions=True) as target:
        yield target


@pytest.fixture(scope="module")
def offline(ensemble_repository, credit_holdout):
    """Per version: calibrated probabilities and margins of the first N holdout applicants, computed offline."""
    out = {}
    for version in ("1", "2", "3"):
        entry = load_entry(ensemble_repository / "credit-risk" / version)
        x = FeatureAssembler(entry.preprocessing).assemble_many(credit_holdout.records[:N])
        logits = ort.InferenceSession(str(entry.model_path), providers=["CPUExecutionProvider"]).run(None, {"features": x})[0]
        out[version] = (entry.manifest.calibration.probabilities(logits, 1), logits[:, 1] - logits[:, 0])
    return out


def requests(prefix: str, holdout, n: int = N):
    return [pb.PredictRequest(request_id=f"{prefix}-{i}", entity_id=eid, attributes=to_attributes(rec))
            for i, (eid, rec) in enumerate(zip(holdout.entity_ids[:n], holdout.records))]


def metric(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_shadow_is_compared_in_metrics_and_never_served(all_versions, ensemble_repository, credit_holdout,
                                                              offline, tmp_path):
    policy = DecisionPolicy.from_toml(CONFIG_DIR / "credit-risk" / "policy.toml")
    labels = {"model": "credit-risk", "primary_version": "3", "shadow_version": "2"}
    before = {a: metric("prediction_shadow_decisions_total", **labels, agreement=a) for a in ("agree", "disagree")}
    diff_count0 = metric("prediction_shadow_logit_difference_count", **labels)
    diff_sum0 = metric("prediction_shadow_logit_difference_sum", **labels)
    async with prediction_service(all_versions, ensemble_repository, tmp_path, models=["credit-risk"],
                                  shadows={"credit-risk": "2"}) as (stub, predictor):
        replies = await asyncio.gather(*(stub.Predict(r) for r in requests("shadow", credit_holdout)))
        await predictor.predictor.drain_background()
    primary_p, primary_margin = offline["3"]
    shadow_p, shadow_margin = offline["2"]
    # served: the primary (latest) version only
    assert all(r.model_version == "3" for r in replies)
    np.testing.assert_allclose([r.probability for r in replies], primary_p, atol=1e-6)
    # recorded: one logit difference and one agreement per decision, equal to the offline comparison
    assert metric("prediction_shadow_logit_difference_count", **labels) - diff_count0 == N
    assert metric("prediction_shadow_logit_difference_sum", **labels) - diff_sum0 == pytest.approx(
        np.abs(shadow_margin - primary_margin).sum(), abs=1e-3)
    # agreement is of the two models under one policy: the bands of their probabilities, whatever
    # review the served decision carries for missing data
    disagree = sum(policy.band(float(s)).decision != policy.band(float(p)).decision for s, p in zip(shadow_p, primary_p))
    assert metric("prediction_shadow_decisions_total", **labels, agreement="disagree") - before["disagree"] == disagree
    assert metric("prediction_shadow_decisions_total", **labels, agreement="agree") - before["agree"] == N - disagree


async def test_a_failing_shadow_never_fails_the_primary(ensemble_repository, credit_holdout, offline, tmp_path):
    """This InferenceService loads only the latest version, so every shadow call is refused."""
    async with inference_service(ensemble_repository) as latest_only:
        failures0 = metric("prediction_shadow_failures_total", model="credit-risk", shadow_version="1",
                           cause="VERSION_CONTRACT_BROKEN")
        async with prediction_service(latest_only, ensemble_repository, tmp_path, models=["credit-risk"],
                                      shadows={"credit-risk": "1"}) as (stub, predictor):
            replies = await asyncio.gather(*(stub.Predict(r) for r in requests("shadow-down", credit_holdout, 10)))
            await predictor.predictor.drain_background()
    np.testing.assert_allclose([r.probability for r in replies], offline["3"][0][:10], atol=1e-6)
    assert metric("prediction_shadow_failures_total", model="credit-risk", shadow_version="1",
                  cause="VERSION_CONTRACT_BROKEN") - failures0 == 10


async def test_ensemble_returns_mean_probability_and_spread(all_versions, ensemble_repository, credit_holdout,
                                                            offline, tmp_path):
    async with prediction_service(all_versions, ensemble_repository, tmp_path, models=["credit-risk"],
                                  ensembles={"credit-risk": ["1", "2", "3"]}) as (stub, _):
        reply = await stub.BatchPredict(pb.BatchPredictRequest(requests=requests("ensemble", credit_holdout)))
    members = np.stack([offline[v][0] for v in ("1", "2", "3")])
    got = [r.prediction for r in reply.results]
    assert all(r.model_version == "1+2+3" for r in got)
    np.testing.assert_allclose([r.probability for r in got], members.mean(axis=0), atol=1e-6)
    np.testing.assert_allclose([r.spread for r in got], members.max(axis=0) - members.min(axis=0), atol=1e-6)
    assert max(r.spread for r in got) > 0  # different seeds do disagree somewhat


async def test_spread_above_the_bound_routes_to_review_with_its_own_reason(all_versions, ensemble_repository,
                                                                             credit_holdout, tmp_path):
    """A policy with a tight bound (0.02): uncertain applicants go to REVIEW with MODEL_UNCERTAIN first."""
    config = tmp_path / "config"
    shutil.copytree(CONFIG_DIR / "credit-risk", config / "credit-risk")
    policy_file = config / "credit-risk" / "policy.toml"
    text = policy_file.read_text().split("\n[missing_data]")[0]  # uncertainty alone: no missing-data rule
    policy_file.write_text(text.replace("max_spread = 0.15", "max_spread = 0.02")
                           .replace('"credit-risk-policy/v4"', '"credit-risk-policy/test-tight"'))
    policy = DecisionPolicy.from_toml(policy_file)
    routed0 = metric("prediction_uncertain_decisions_total", model="credit-risk")
    async with prediction_service(all_versions, ensemble_repository, tmp_path, models=["credit-risk"],
                                  config_dir=config, ensembles={"credit-risk": ["1", "2", "3"]}) as (stub, _):
        replies = await asyncio.gather(*(stub.Predict(r) for r in requests("uncertain", credit_holdout)))
    uncertain = [r for r in replies if r.spread > 0.02]
    certain = [r for r in replies if r.spread <= 0.02]
    assert uncertain and certain, "the tight bound should split this sample"
    for r in uncertain:
        assert r.decision_label == "REVIEW" and r.reason_codes[0] == "MODEL_UNCERTAIN"
        assert r.reason_codes[1] == policy.band(r.probability).reason_code  # the band's reason is kept
    for r in certain:
        assert r.decision_label == policy.band(r.probability).decision and "MODEL_UNCERTAIN" not in r.reason_codes
    assert metric("prediction_uncertain_decisions_total", model="credit-risk") - routed0 == len(uncertain)


def test_ensemble_members_and_shadow_must_share_the_preprocessing(ensemble_repository, tmp_path):
    """Version 4 is refitted differently (another mean): it cannot share a vector with 1, 2 and 3."""
    import json

    from mlpair.contracts.manifest import MANIFEST_FILE, PREPROCESSING_FILE
    from mlpair.contracts.preprocessing import Preprocessing

    repo = tmp_path / "models"
    shutil.copytree(ensemble_repository / "credit-risk", repo / "credit-risk")
    v4 = repo / "credit-risk" / "4"
    shutil.copytree(repo / "credit-risk" / "3", v4)
    data = json.loads((v4 / PREPROCESSING_FILE).read_text())
    data["numeric"]["Age"]["mean"] += 1.0
    prep = Preprocessing.model_validate(data)
    prep.save(v4 / PREPROCESSING_FILE)
    manifest = json.loads((v4 / MANIFEST_FILE).read_text())
    manifest["versions"].update(model_version="4", preprocessing_hash=prep.hash)
    (v4 / MANIFEST_FILE).write_text(json.dumps(manifest))

    for kwargs in ({"ensemble": ["3", "4"]}, {"shadow": "3"}):
        with pytest.raises(ConfigurationError, match="other preprocessing"):
            ModelFamily.load("credit-risk", CONFIG_DIR, repo, **kwargs)
    with pytest.raises(ConfigurationError, match="no version '9'"):
        ModelFamily.load("credit-risk", CONFIG_DIR, ensemble_repository, ensemble=["1", "9"])
    family = ModelFamily.load("credit-risk", CONFIG_DIR, ensemble_repository, ensemble=["1", "2"], shadow="3")
    assert [m.version for m in family.members] == ["1", "2"] and family.shadow.version == "3"
