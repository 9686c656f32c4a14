"""C61: a missing attribute a credit decision rests on never yields an automatic decision.

The credit-risk policy (``config/credit-risk/policy.toml``, ``[missing_data]``) requires Income,
Amount, Time and Records, and at most one of Expenses, Assets and Debt missing; a request that
breaks the rule is REVIEW with a reason code naming what is missing (or, where the policy says
``action = "refuse"``, INVALID_ARGUMENT), through Predict and BatchPredict, on the row-wise path
(fewer than 8 items) and the columnar one.
"""

from __future__ import annotations

import re
import shlex
import shutil

import grpc
import pytest
from google.rpc import code_pb2

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.client import to_attributes
from mlpair.contracts.schema import FeatureSchema
from mlpair.prediction.families import ConfigurationError, ModelFamily
from mlpair.rpc import error_info
from tests.e2e.conftest import crm_count, prediction_service
from tests.support import CONFIG_DIR, CREDIT_SCHEMA, REPO_ROOT

# A safe applicant (APPROVE when complete) and a risky one (DECLINE when complete).
SAFE = {"Seniority": 20, "Home": "owner", "Time": 24, "Age": 45, "Marital": "married", "Records": "no",
        "Job": "fixed", "Expenses": 50, "Income": 250, "Assets": 10000, "Debt": 0, "Amount": 500, "Price": 1500}
RISKY = {"Seniority": 0, "Home": "other", "Time": 60, "Age": 21, "Marital": "single", "Records": "yes",
         "Job": "partime", "Expenses": 90, "Income": 40, "Assets": 0, "Debt": 4000, "Amount": 3000, "Price": 3100}
# Each way of leaving a required attribute out, with the reason codes it must give first.
BROKEN = [
    ({"Income": None}, ["INCOME_REQUIRED_MISSING"]),
    ({"Income": 99999999}, ["INCOME_REQUIRED_MISSING"]),     # a sentinel: the source's "unknown"
    ({"Amount": None}, ["AMOUNT_REQUIRED_MISSING"]),
    ({"Time": float("nan")}, ["TIME_REQUIRED_MISSING"]),
    ({"Records": ""}, ["RECORDS_REQUIRED_MISSING"]),         # an empty string is missing
    ({"Assets": None, "Debt": None}, ["FINANCIAL_POSITION_INCOMPLETE"]),
    ({"Records": None, "Expenses": None, "Debt": None}, ["RECORDS_REQUIRED_MISSING", "FINANCIAL_POSITION_INCOMPLETE"]),
]


def request(request_id: str, attributes: dict) -> pb.PredictRequest:
    return pb.PredictRequest(request_id=request_id, entity_id=request_id, model_name="credit-risk",
                             attributes=to_attributes(attributes))


def applicant(base: dict, change: dict) -> dict:
    return {**base, **change}


@pytest.fixture(scope="module")
async def prediction(inference_server, model_repository, tmp_path_factory):
    async with prediction_service(inference_server, model_repository, tmp_path_factory.mktemp("c61")) as served:
        yield served


@pytest.fixture(scope="module")
async def refusing(inference_server, model_repository, tmp_path_factory):
    """A PredictionService whose credit policy refuses such requests instead."""
    config = tmp_path_factory.mktemp("c61-config")
    shutil.copytree(CONFIG_DIR, config, dirs_exist_ok=True)
    policy = config / "credit-risk" / "policy.toml"
    policy.write_text(policy.read_text().replace('action = "review"', 'action = "refuse"', 1))
    async with prediction_service(inference_server, model_repository, tmp_path_factory.mktemp("c61r"),
                                  config_dir=config, models=["credit-risk"]) as served:
        yield served


async def test_c61_a_missing_required_attribute_is_reviewed_never_decided_automatically(prediction):
    stub, predictor = prediction
    before = await crm_count(predictor)
    complete = {base_name: (await stub.Predict(request(f"c61-{base_name}", base))).decision_label
                for base_name, base in (("safe", SAFE), ("risky", RISKY))}
    assert complete == {"safe": "APPROVE", "risky": "DECLINE"}  # automatic when nothing is missing
    singles, items = [], []
    for i, (change, codes) in enumerate(BROKEN):
        for base_name, base in (("safe", SAFE), ("risky", RISKY)):
            singles.append((await stub.Predict(request(f"c61-p{i}-{base_name}", applicant(base, change))), codes))
            items.append((request(f"c61-b{i}-{base_name}", applicant(base, change)), codes))
    # BatchPredict: 14 items (the columnar path) and 2 (row by row)
    columnar = await stub.BatchPredict(pb.BatchPredictRequest(requests=[r for r, _ in items]))
    few = [request(f"c61-few-{i}", applicant(SAFE, change)) for i, (change, _) in enumerate(BROKEN[:2])]
    row_wise = await stub.BatchPredict(pb.BatchPredictRequest(requests=few))
    replies = singles + [(r.prediction, c) for r, (_, c) in zip(columnar.results, items)]
    replies += [(r.prediction, c) for r, (_, c) in zip(row_wise.results, BROKEN[:2])]
    assert len(replies) == 30
    for reply, codes in replies:
        assert reply.decision_label == "REVIEW" and not reply.replayed
        assert list(reply.reason_codes[:len(codes)]) == codes
        band = reply.reason_codes[len(codes)]
        assert band == ("LOW_DEFAULT_RISK" if reply.probability < 0.25 else
                        "ELEVATED_DEFAULT_RISK" if reply.probability < 0.55 else "HIGH_DEFAULT_RISK")
    # the band the model gave is kept beside the rule: both automatic bands were overridden
    assert {r.reason_codes[len(c)] for r, c in replies} >= {"LOW_DEFAULT_RISK", "HIGH_DEFAULT_RISK"}
    # one missing of Expenses, Assets and Debt is allowed: the decision stays automatic
    allowed = await stub.Predict(request("c61-one-of-group", applicant(SAFE, {"Assets": None})))
    assert allowed.decision_label == "APPROVE" and "ASSETS_MISSING_DEFAULTED" in allowed.reason_codes
    assert await crm_count(predictor) == before + 2 + 30 + 1


async def test_c61_a_policy_that_refuses_answers_invalid_argument_naming_what_is_missing(refusing):
    stub, predictor = refusing
    before = await crm_count(predictor)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Predict(request("c61r-1", applicant(SAFE, {"Income": None, "Records": None})))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(refused.value)
    assert info.reason == "REQUIRED_ATTRIBUTE_MISSING"
    assert dict(info.metadata) == {"attributes": "Income,Records",
                                   "reason_codes": "INCOME_REQUIRED_MISSING,RECORDS_REQUIRED_MISSING"}
    assert "Income, Records" in refused.value.details()
    for n in (2, 9):  # row by row and columnar: the same refusal for each broken item, the rest decided
        requests = [request(f"c61r-b{n}-{i}", applicant(SAFE, {"Income": None} if i % 2 else {})) for i in range(n)]
        reply = await stub.BatchPredict(pb.BatchPredictRequest(requests=requests))
        for i, result in enumerate(reply.results):
            if i % 2:
                assert result.error.code == code_pb2.INVALID_ARGUMENT
                [detail] = result.error.details
                item_info = type(info)()
                assert detail.Unpack(item_info) and item_info.reason == "REQUIRED_ATTRIBUTE_MISSING"
                assert dict(item_info.metadata) == {"attributes": "Income", "reason_codes": "INCOME_REQUIRED_MISSING"}
            else:
                assert result.prediction.decision_label == "APPROVE"
    assert await crm_count(predictor) == before + 1 + 5  # the complete items of each batch; nothing refused


def test_c61_a_policy_requiring_an_attribute_the_schema_lacks_does_not_start(model_repository, tmp_path):
    shutil.copytree(CONFIG_DIR, tmp_path, dirs_exist_ok=True)
    policy = tmp_path / "credit-risk" / "policy.toml"
    policy.write_text(policy.read_text().replace('required = ["Income",', 'required = ["Salary", "Income",', 1))
    with pytest.raises(ConfigurationError, match="Salary"):
        ModelFamily.load("credit-risk", tmp_path, model_repository)


def test_c61_the_readme_examples_send_a_complete_applicant():
    readme = (REPO_ROOT / "README.md").read_text()
    names = set(FeatureSchema.from_toml(CREDIT_SCHEMA).attribute_names)
    pythons = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "applicant = {" in b]
    assert pythons and all(set(eval(re.search(r"applicant = (\{.*?\})\n", b, re.S).group(1))) == names for b in pythons)
    [shell] = [b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "mlpair predict --family" in b]
    words = shlex.split(shell.replace("\\\n", " "))
    assert {words[i + 1].split("=")[0] for i, w in enumerate(words) if w == "--attr"} == names


async def test_c61_a_review_for_missing_data_is_no_disagreement_with_the_shadow(inference_server, model_repository,
                                                                                tmp_path_factory):
    """The shadow comparison is of two models under one policy: a row reviewed for a missing
    required attribute is compared by the bands the two probabilities fall in, so version 1
    shadowing itself agrees on every row, reviewed or not (the served REVIEW counted as a
    disagreement, and a healthy canary failed its decision-disagreement bound)."""
    from mlpair.prediction import metrics

    def count(agreement: str) -> float:
        return metrics.SHADOW_DECISIONS.labels("credit-risk", "1", "1", agreement)._value.get()

    async with prediction_service(inference_server, model_repository, tmp_path_factory.mktemp("c61s"),
                                  models=["credit-risk"], shadows={"credit-risk": "1"}) as (stub, predictor):
        before = count("agree"), count("disagree")
        broken = [applicant(base, change) for change, _ in BROKEN for base in (SAFE, RISKY)]
        replies = [await stub.Predict(request(f"c61s-{i}", a)) for i, a in enumerate([SAFE, RISKY, *broken])]
        assert [r.decision_label for r in replies[2:]] == ["REVIEW"] * len(broken)
        await predictor.predictor.drain_background()
        assert (count("agree") - before[0], count("disagree") - before[1]) == (len(replies), 0)
