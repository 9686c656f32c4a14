"""Explanations over gRPC: occlusion against the schema default, one batched inference call."""

from __future__ import annotations

import re

import numpy as np
import onnxruntime as ort
import pytest
from prometheus_client import REGISTRY

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.contracts.assembly import FeatureAssembler
from tests.e2e.conftest import prediction_service


@pytest.fixture(scope="module")
async def prediction(inference_server, model_repository, tmp_path_factory):
    async with prediction_service(inference_server, model_repository, tmp_path_factory.mktemp("crm")) as served:
        yield served


def offline_contributions(entry, record) -> tuple[float, np.ndarray]:
    """p(x) and p(x) - p(x with feature k at its default) for every k, computed without the services."""
    assembler = FeatureAssembler(entry.preprocessing)
    x = assembler.assemble(record).vector
    rows = np.concatenate([x[None, :], assembler.occlusions(x)])
    logits = ort.InferenceSession(str(entry.model_path), providers=["CPUExecutionProvider"]).run(None, {"features": rows})[0]
    p = entry.manifest.calibration.probabilities(logits, entry.manifest.positive_index)
    return p[0], p[0] - p[1:]


def infer_calls(model: str) -> tuple[float, float]:
    labels = {"model": model}
    return (REGISTRY.get_sample_value("prediction_inference_call_rows_count", labels) or 0.0,
            REGISTRY.get_sample_value("prediction_inference_call_rows_sum", labels) or 0.0)


@pytest.mark.parametrize("family", ["credit-risk", "churn"])
async def test_contributions_are_occlusions_against_the_schema_default_in_one_call(prediction, family, request):
    stub, _ = prediction
    entry = request.getfixturevalue("credit_entry" if family == "credit-risk" else "churn_entry")
    holdout = request.getfixturevalue("credit_holdout" if family == "credit-risk" else "churn_holdout")
    schema = entry.preprocessing.feature_schema
    record = holdout.records[3]
    calls0, rows0 = infer_calls(family)
    reply = await stub.Predict(pb.PredictRequest(request_id=f"explain-{family}", entity_id="x", model_name=family,
                                                 attributes=to_attributes(record), explain=True))
    calls, rows = infer_calls(family)
    assert (calls - calls0, rows - rows0) == (1, 1 + len(schema.features))  # ONE call: the row and its occlusions

    p, expected = offline_contributions(entry, record)
    assert reply.probability == pytest.approx(p, abs=1e-6)
    got = {c.feature: c.contribution for c in reply.contributions}
    assert set(got) == set(schema.attribute_names)
    for name, c in zip(schema.attribute_names, expected):
        assert got[name] == pytest.approx(c, abs=1e-6)
    magnitudes = [abs(c.contribution) for c in reply.contributions]
    assert magnitudes == sorted(magnitudes, reverse=True)

    top = reply.contributions[0]
    assert reply.top_reasons[0] == top.text
    assert top.text.startswith(next(f.display for f in schema.features if f.name == top.feature))
    assert schema.target.outcome in top.text and "points" in top.text
    outcome_code = schema.target.outcome.upper().replace(" ", "_")
    assert re.fullmatch(rf"{top.feature.upper()}_(RAISES|LOWERS)_{outcome_code}", top.reason_code)
    assert 1 <= len(reply.top_reasons) <= 3


async def test_a_feature_at_its_default_contributes_nothing(prediction, credit_holdout, credit_entry):
    stub, _ = prediction
    record = {**credit_holdout.records[4], "Job": None}  # missing → the schema default
    reply = await stub.Predict(pb.PredictRequest(request_id="explain-default", entity_id="x",
                                                 attributes=to_attributes(record), explain=True))
    job = next(c for c in reply.contributions if c.feature == "Job")
    assert job.contribution == 0.0 and job.reason_code == "JOB_KEEPS_DEFAULT_RISK"
    assert job.text not in reply.top_reasons


async def test_without_explain_nothing_extra_is_computed(prediction, credit_holdout):
    stub, _ = prediction
    calls0, rows0 = infer_calls("credit-risk")
    reply = await stub.Predict(pb.PredictRequest(request_id="explain-off", entity_id="x",
                                                 attributes=to_attributes(credit_holdout.records[5])))
    assert infer_calls("credit-risk") == (calls0 + 1, rows0 + 1)
    assert not reply.contributions and not reply.top_reasons
