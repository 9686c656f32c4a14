"""A user's own data and a model trained elsewhere, served by real processes as a user would run them.

1. The credit holdout written out as a CSV with its labels: `mlpair train` with a schema whose source
   is that file, then `mlpair serve inference` and `mlpair serve prediction`, then Predict.
2. A scikit-learn model converted with skl2onnx: `mlpair import-model`, then the same pair serves it
   with the logits of in-process ONNX Runtime, bit for bit, and the decisions they lead to.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.client import infer_logits
from mlpair.contracts.assembly import FeatureAssembler
from mlpair.contracts.manifest import load_latest
from mlpair.contracts.schema import FeatureSchema
from mlpair.prediction.deciding.policy import DecisionPolicy
from tests.support import CONFIG_DIR, CREDIT_SCHEMA, defaulted
from tests.support.e2e import expected_probabilities, predict_request
from tests.support.outside import credit_tables, outside_model, schema_with_source
from tests.support.pair import pair, running

N_PREDICTS = 60


def mlpair(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlpair.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def config_dir(folder, schema_source: str | None):
    """A config folder holding credit-risk's policy and a schema (the shipped one, or with another source)."""
    family = folder / "config" / "credit-risk"
    family.mkdir(parents=True)
    shutil.copy(CONFIG_DIR / "credit-risk" / "policy.toml", family / "policy.toml")
    shutil.copy(CONFIG_DIR / "credit-risk" / "training.toml", family / "training.toml")
    if schema_source is None:
        shutil.copy(CREDIT_SCHEMA, family / "feature-schema.toml")
    else:
        schema_with_source(family, schema_source)
    return folder / "config"


def predict_all(address: str, ids: list[str], records: list[dict]):
    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.PredictionServiceStub(channel)
            return [await stub.Predict(predict_request(f"own-{i}", r), timeout=30) for i, r in zip(ids, records)]

    import asyncio

    return asyncio.run(run())


def check_decisions(replies, entry, records, probabilities) -> None:
    policy = DecisionPolicy.from_toml(CONFIG_DIR / "credit-risk" / "policy.toml")
    assert len(replies) == len(records) == N_PREDICTS
    for reply, record, p in zip(replies, records, probabilities):
        assert reply.model_version == entry.manifest.model_version and not reply.fallback
        assert reply.probability == pytest.approx(p, abs=1e-6)
        verdict = policy.decide(reply.probability, missing=defaulted(entry, record))
        assert reply.decision_label == verdict.decision and reply.reason_codes[0] == verdict.reason_codes[0]


def test_own_csv_trains_and_is_served_in_three_commands(tmp_path):
    holdout = credit_tables()["holdout"]
    config = config_dir(tmp_path, "csv: applicants.csv")
    holdout.to_csv(config / "credit-risk" / "applicants.csv", index=False)

    trained = mlpair("train", "--schema", "config/credit-risk/feature-schema.toml", "--model-repository", "models",
                     cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    assert "credit-risk version 1 trained" in trained.stderr
    entry = load_latest(tmp_path / "models", "credit-risk")
    assert entry.manifest.data_source["source"] == "csv: applicants.csv"
    assert entry.manifest.data_source["rows"] == len(holdout) == 891
    assert sum(entry.manifest.data_source["split"][k] for k in ("train", "calibration", "holdout")) == 891

    schema = FeatureSchema.from_toml(config / "credit-risk" / "feature-schema.toml")
    records = [{k: (None if v != v else v) for k, v in row.items() if k in schema.attribute_names}
               for row in holdout.head(N_PREDICTS).to_dict("records")]
    with running(pair(tmp_path / "pair", tmp_path / "models", prediction_env={"PREDICTION_CONFIG_DIR": str(config)})) as p:
        replies = predict_all(p.prediction.address, [str(i) for i in range(N_PREDICTS)], records)
        one = mlpair("predict", "--target", p.prediction.address, "--family", "credit-risk", "--entity-id", "a-1",
                     *[a for k, v in records[0].items() if v is not None for a in ("--attr", f"{k}={v}")], cwd=tmp_path)
    check_decisions(replies, entry, records, expected_probabilities(entry, records))
    assert one.returncode == 0, one.stderr
    assert replies[0].decision_label in one.stdout


@pytest.mark.parametrize("kind", ["logistic", "boosting"])
def test_an_imported_model_is_served_with_the_logits_of_in_process_scoring(kind, tmp_path):
    tables = credit_tables()
    preprocessing, model = outside_model(tables["train"], kind)
    onnx.save_model(model, str(tmp_path / "model.onnx"))
    preprocessing.save(tmp_path / "preprocessing.json")
    tables["calibration"].to_csv(tmp_path / "calibration.csv", index=False)
    config = config_dir(tmp_path, None)

    imported = mlpair("import-model", "--model", "model.onnx", "--schema", "config/credit-risk/feature-schema.toml",
                      "--preprocessing", "preprocessing.json", "--calibration-data", "calibration.csv",
                      "--model-repository", "models", cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.startswith("credit-risk version 1 imported from model.onnx")
    entry = load_latest(tmp_path / "models", "credit-risk")

    schema = FeatureSchema.from_toml(CREDIT_SCHEMA)
    records = [{k: (None if v != v else v) for k, v in row.items() if k in schema.attribute_names}
               for row in tables["holdout"].to_dict("records")]
    x = FeatureAssembler(preprocessing).assemble_many(records)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # as the service runs it (a tree ensemble's sum depends on the thread count)
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), options, providers=["CPUExecutionProvider"])
    in_process = session.run(["probabilities"], {"float_input": x})[0]

    with running(pair(tmp_path / "pair", tmp_path / "models", prediction_env={"PREDICTION_CONFIG_DIR": str(config)})) as p:
        served, version = infer_logits(p.inference.address, "credit-risk", "", "credit-risk/v1", x)
        replies = predict_all(p.prediction.address, [str(i) for i in range(N_PREDICTS)], records[:N_PREDICTS])
    assert version == "1" and served.shape == (891, 2)
    np.testing.assert_array_equal(served, in_process)
    probabilities = entry.manifest.calibration.probabilities(in_process[:N_PREDICTS], entry.manifest.positive_index)
    check_decisions(replies, entry, records[:N_PREDICTS], probabilities)
