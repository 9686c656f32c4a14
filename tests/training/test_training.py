"""Training: reproducibility, the repository entry, export parity, calibration and the version triple."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest

from mlpair.contracts.manifest import SCORE_BASELINE, ManifestError, load_entry
from mlpair.training.export import ExportParityError, check_parity
from mlpair.training.model import MLPClassifier, TrainConfig, TrainingRun, train_classifier
from mlpair.training.pipeline import fit_calibration, load_train_config, train_family
from tests.support import CHURN_SCHEMA, CONFIG_DIR, CREDIT_SCHEMA

# Holdout ROC AUC each family must reach (the acceptance; plain baselines: 0.83 / 0.845).
MIN_ROC_AUC = {"credit-risk": 0.80, "churn": 0.82}


def onnx_logits(entry, x):
    session = ort.InferenceSession(str(entry.model_path), providers=["CPUExecutionProvider"])
    return session.run(None, {"features": x})[0]


@pytest.fixture(params=["credit-risk", "churn"])
def entry(request):
    return request.getfixturevalue("credit_entry" if request.param == "credit-risk" else "churn_entry")


def test_same_seed_gives_identical_logits(tmp_path, credit_entry):
    again, fresh = train_family(CREDIT_SCHEMA, tmp_path, show_progress=False)
    assert fresh
    x = np.random.default_rng(1).normal(size=(64, credit_entry.manifest.n_features)).astype(np.float32)
    np.testing.assert_array_equal(onnx_logits(again, x), onnx_logits(credit_entry, x))
    assert again.manifest.versions == credit_entry.manifest.versions


def test_entry_holds_model_manifest_and_quality(entry):
    m = entry.manifest
    assert (entry.path / "model.onnx").is_file()
    assert m.inputs[0].shape == [-1, entry.preprocessing.n_features]
    assert m.metrics["holdout_calibrated"]["roc_auc"] >= MIN_ROC_AUC[m.model_name]
    assert m.training["onnx_parity_max_abs_diff"] <= 1e-4
    assert m.data_source["source"] == entry.preprocessing.feature_schema.source
    assert set(m.baselines) == {*entry.preprocessing.feature_schema.attribute_names, SCORE_BASELINE}
    score = m.baselines[SCORE_BASELINE]
    assert score["n"] == m.data_source["split"]["calibration"] and len(score["quantiles"]) == 101
    assert 0.0 <= score["quantiles"][0] <= score["quantiles"][50] <= score["quantiles"][-1] <= 1.0
    for key in ("holdout_uncalibrated", "holdout_calibrated", "holdout_temperature", "holdout_platt"):
        assert {"roc_auc", "brier", "ece_15", "n"} <= set(m.metrics[key])


def test_churn_positive_class_and_split(churn_entry, churn_data):
    m = churn_entry.manifest
    assert m.data_source["target"] == "churn == 'Yes'"
    assert m.class_names[m.positive_index] == "Yes"
    assert churn_data.labels.mean() == pytest.approx(1869 / 7043)
    split = m.data_source["split"]
    assert split["train"] + split["calibration"] + split["holdout"] == 7043


def test_isotonic_is_fitted_only_with_a_thousand_calibration_samples(credit_entry, churn_entry):
    assert credit_entry.manifest.calibration.n_samples < 1000 and credit_entry.manifest.calibration.isotonic is None
    assert churn_entry.manifest.calibration.n_samples >= 1000 and churn_entry.manifest.calibration.isotonic is not None
    assert "holdout_isotonic" in churn_entry.manifest.metrics and "holdout_isotonic" not in credit_entry.manifest.metrics


def test_isotonic_cannot_be_chosen_on_too_few_samples():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(500, 2)).astype(np.float32)
    labels = (rng.random(500) < 1 / (1 + np.exp(logits[:, 0] - logits[:, 1]))).astype(int)
    with pytest.raises(ValueError, match="1000"):
        fit_calibration(logits, labels, 1, TrainConfig(calibration="isotonic"))


def test_up_to_date_entry_is_reused(model_repository, credit_entry):
    entry, fresh = train_family(CREDIT_SCHEMA, model_repository, show_progress=False)
    assert not fresh and entry.path == credit_entry.path


def test_another_seed_is_a_new_version_on_the_same_split_and_features(credit_entry, tmp_path):
    """Ensemble members: a new version, different weights, same holdout and preprocessing."""
    shutil.copytree(credit_entry.path, tmp_path / "credit-risk" / "1")
    config = dataclasses.replace(load_train_config(CREDIT_SCHEMA), seed=7)
    other, fresh = train_family(CREDIT_SCHEMA, tmp_path, config, show_progress=False)
    assert fresh and other.manifest.model_version == "2"
    assert other.manifest.versions.preprocessing_hash == credit_entry.manifest.versions.preprocessing_hash
    assert other.manifest.data_source["split"] == credit_entry.manifest.data_source["split"]
    x = np.zeros((1, credit_entry.manifest.n_features), np.float32)
    assert not np.array_equal(onnx_logits(other, x), onnx_logits(credit_entry, x))


def test_training_config_files(tmp_path):
    assert load_train_config(CREDIT_SCHEMA).early_stopping_patience > 0
    assert load_train_config(CHURN_SCHEMA) == TrainConfig.from_toml(CONFIG_DIR / "churn" / "training.toml")
    bad = tmp_path / "training.toml"
    bad.write_text("epoch = 3\n")
    with pytest.raises(ValueError, match="epoch"):
        TrainConfig.from_toml(bad)
    with pytest.raises(ValueError):
        TrainConfig(calibration="beta")


def test_early_stopping_needs_validation_data():
    x = np.zeros((8, 3), np.float32)
    with pytest.raises(ValueError, match="validation"):
        train_classifier(x, np.zeros(8, int), TrainConfig(early_stopping_patience=2))


def test_dynamic_batch_dimension(entry):
    for rows in (1, 7, 300):
        x = np.zeros((rows, entry.manifest.n_features), dtype=np.float32)
        assert onnx_logits(entry, x).shape == (rows, 2)


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


def test_label_smoothing_is_recorded_for_calibration_to_undo():
    rng = np.random.default_rng(1)
    margin = rng.normal(0, 2, 2000)
    labels = (rng.random(2000) < 1 / (1 + np.exp(-margin))).astype(int)
    logits = np.stack([np.zeros_like(margin), margin], axis=1).astype(np.float32)
    fitted = fit_calibration(logits, labels, 1, TrainConfig(label_smoothing=0.1))
    assert fitted.label_smoothing == 0.1
    p = fitted.probabilities(logits, 1)
    assert p.min() == 0.0 and p.max() == 1.0  # the inverse reaches what a smoothed softmax cannot


def test_the_manifest_says_how_training_ended(credit_entry, churn_entry):
    """credit-risk stops early (patience 5 after the best calibration-split loss); churn runs every epoch."""
    credit = credit_entry.manifest.training
    config = credit["config"]
    assert credit["epochs_run"] < config["epochs"], "credit-risk's early stopping ends training before 40 epochs"
    assert credit["epochs_run"] == credit["best_epoch"] + config["early_stopping_patience"]
    run = TrainingRun(credit["epochs_run"], credit["best_epoch"], config["epochs"])
    assert run.describe() == (f"stopped early at epoch {credit['epochs_run']} of {config['epochs']} "
                              f"(best epoch {credit['best_epoch']})")
    churn = churn_entry.manifest.training
    assert churn["config"]["early_stopping_patience"] == 0
    assert churn["epochs_run"] == churn["best_epoch"] == churn["config"]["epochs"]
    assert TrainingRun(churn["epochs_run"], churn["best_epoch"], churn["config"]["epochs"]).describe() == \
        f"all {churn['config']['epochs']} epochs"


def test_model_entries_are_readable_by_the_serving_user(model_repository):
    """The images serve as uid 10001, often not the user who trained: folders 0755, files 0644."""
    import stat

    for family in ("credit-risk", "churn"):
        version = model_repository / family / "1"
        assert stat.S_IMODE(version.stat().st_mode) == 0o755
        files = list(version.iterdir())
        assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in files), \
            {f.name: oct(f.stat().st_mode) for f in files}


def test_the_logistic_regression_baseline_is_the_penalised_optimum(credit_entry, credit_data):
    """Same training split and assembled features as the network; its gradient vanishes at the fit."""
    from mlpair.contracts.assembly import FeatureAssembler
    from mlpair.contracts.metrics import roc_auc
    from mlpair.training.baseline import _objective, fit_logistic_regression, predict_probability
    from mlpair.training.data import stratified_split

    splits = stratified_split(credit_data.labels, int(credit_entry.manifest.data_source["split"]["seed"]))
    train, holdout = credit_data.subset(splits["train"]), credit_data.subset(splits["holdout"])
    assembler = FeatureAssembler(credit_entry.preprocessing)
    x = assembler.assemble_many(train.records).astype(np.float64)
    params = fit_logistic_regression(x, train.labels)
    _, gradient = _objective(params, x, train.labels.astype(np.float64), 1.0)
    assert np.abs(gradient).max() < 1e-3 * len(x) ** 0.5
    auc = roc_auc(holdout.labels, predict_probability(params, assembler.assemble_many(holdout.records)))
    served = credit_entry.manifest.metrics["holdout_calibrated"]["roc_auc"]
    assert 0.80 < auc < served + 0.03, (auc, served)  # a real baseline, in the network's neighbourhood
