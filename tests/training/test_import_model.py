"""`mlpair import-model`: a scikit-learn model converted with skl2onnx becomes a version like a trained one."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from mlpair import cli
from mlpair.contracts.assembly import FeatureAssembler
from mlpair.contracts.manifest import load_entry
from mlpair.contracts.schema import FeatureSchema
from mlpair.inference.runtimes.onnx import OnnxRuntime
from mlpair.inference.settings import InferenceSettings
from mlpair.training.data import dataset_from_frame
from tests.support import CHURN_SCHEMA, CREDIT_SCHEMA
from tests.support.outside import credit_tables, outside_model


@pytest.fixture(scope="module")
def tables():
    return credit_tables()


@pytest.fixture(scope="module")
def bring(tables, tmp_path_factory):
    """Writes an outside model and its files into a fresh folder; returns the `mlpair import-model` arguments."""

    def write(name: str = "logistic", calibration=None, **options) -> tuple[list[str], object]:
        folder = tmp_path_factory.mktemp(name)
        preprocessing, model = outside_model(tables["train"], **({"kind": name} if name in ("logistic", "boosting") else {}), **options)
        onnx.save_model(model, str(folder / "model.onnx"))
        preprocessing.save(folder / "preprocessing.json")
        (calibration if calibration is not None else tables["calibration"]).to_csv(folder / "calibration.csv", index=False)
        args = ["import-model", "--model", str(folder / "model.onnx"), "--schema", str(CREDIT_SCHEMA),
                "--preprocessing", str(folder / "preprocessing.json"), "--calibration-data", str(folder / "calibration.csv"),
                "--model-repository", str(folder / "models")]
        return args, folder

    return write


def one_thread() -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return options


def holdout_x(tables, entry) -> np.ndarray:
    data = dataset_from_frame(tables["holdout"], FeatureSchema.from_toml(CREDIT_SCHEMA), "holdout")
    return FeatureAssembler(entry.preprocessing).assemble_many(data.records)


@pytest.mark.parametrize("kind", ["logistic", "boosting"])
def test_an_imported_model_is_a_version_with_the_same_logits_as_the_model_itself(kind, bring, tables, capsys):
    args, folder = bring(kind)
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"credit-risk version 1 imported from {folder / 'model.onnx'} into {folder / 'models/credit-risk/1'}")
    entry = load_entry(folder / "models" / "credit-risk" / "1")
    m = entry.manifest
    assert sorted(p.name for p in entry.path.iterdir()) == ["manifest.json", "model.onnx", "preprocessing.json"]
    assert m.format_version == 1 and m.versions.model_version == "1"
    assert m.versions.feature_schema_version == "credit-risk/v1"
    assert m.versions.preprocessing_hash == entry.preprocessing.hash
    assert [(t.name, t.shape) for t in m.inputs] == [("features", [-1, 30])]
    assert [(t.name, t.shape) for t in m.outputs] == [("logits", [-1, 2])]
    assert m.class_names == ["not bad", "bad"] and m.positive_index == 1
    assert m.calibration.method == "temperature" and m.calibration.n_samples == len(tables["calibration"]) == 891
    assert m.training["imported"]["input"] == "float_input" and m.training["imported"]["output"] == "probabilities"
    assert m.metrics["calibration_set_calibrated"]["roc_auc"] > 0.8
    assert "format_version" not in json.loads((entry.path / "manifest.json").read_text())  # format 1: written without it

    # in-process scoring of the ONNX the user brought, and the serving runtime on the stored version: bit-identical
    # (with the service's one intra-op thread: a tree ensemble sums its trees in another order on several threads)
    x = holdout_x(tables, entry)
    assert InferenceSettings().intra_op_threads == 1
    theirs = ort.InferenceSession(str(folder / "model.onnx"), one_thread(), providers=["CPUExecutionProvider"])
    expected = theirs.run(["probabilities"], {"float_input": x})[0]
    served = OnnxRuntime(entry.model_path, provider="cpu").run(x)
    assert served.dtype == np.float32 and served.shape == (891, 2)
    np.testing.assert_array_equal(served, expected)


def test_a_second_import_is_the_next_version(bring):
    args, folder = bring("logistic")
    assert cli.main(args) == 0 and cli.main(args) == 0
    assert sorted(p.name for p in (folder / "models" / "credit-risk").iterdir()) == ["1", "2"]
    assert load_entry(folder / "models" / "credit-risk" / "2").manifest.model_version == "2"


REFUSALS = {
    "one feature fewer": (
        dict(drop_feature=True),
        "model signature: expected one input [batch, 30] float32 (a dynamic batch), got float_input [batch, 29] float32"),
    "a fixed batch": (
        dict(batch=1), "model signature: expected one input [batch, 30] float32 (a dynamic batch), got float_input [1, 30] float32"),
    "float64 input": (
        dict(double=True), "model signature: expected one input [batch, 30] float32 (a dynamic batch), got float_input [batch, 30] float64"),
    "probabilities, not logits": (
        dict(raw_scores=False), "output 'probabilities' holds probabilities (each row sums to 1), not logits"),
    "classes swapped": (
        dict(flip=True), "is logits column 1 the positive class 'bad'?"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_model_that_does_not_fit_the_schema_is_refused_with_one_line(case, bring, capsys):
    options, expected = REFUSALS[case]
    args, folder = bring(**options)
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"mlpair import-model: {folder / 'model.onnx'}: ") and expected in err
    assert not (folder / "models" / "credit-risk").exists() or not any((folder / "models" / "credit-risk").iterdir())


@pytest.mark.parametrize(("change", "expected"), [
    (lambda a, f: a + ["--output", "label"], "model signature: expected output logits [batch, 2] float32, got label [batch] int64"),
    (lambda a, f: a + ["--output", "scores"], "model has no output 'scores'; its outputs: label [batch] int64, probabilities [batch, 2] float32"),
    (lambda a, f: [x if x != str(f / "preprocessing.json") else str(f / "churn.json") for x in a],
     "was fitted for feature schema 'churn/v1' of 'churn', not the one in"),
    (lambda a, f: [x if x != str(f / "model.onnx") else str(f / "garbage.onnx") for x in a], "as an ONNX model"),
    (lambda a, f: [x if x != str(f / "calibration.csv") else str(f / "no-target.csv") for x in a],
     "calibration set {f}/no-target.csv has no target column 'Status'"),
    (lambda a, f: [x if x != str(f / "calibration.csv") else str(f / "few.csv") for x in a],
     "calibration set {f}/few.csv has 49 rows; at least 50 are needed"),
    (lambda a, f: [x if x != str(f / "calibration.csv") else str(f / "extra.csv") for x in a],
     "calibration set {f}/extra.csv has column(s) the schema does not name: Branch"),
    (lambda a, f: [x if x != str(f / "calibration.csv") else str(f / "calibration.xlsx") for x in a],
     "calibration set {f}/calibration.xlsx: expected a .csv or .parquet file"),
])
def test_bad_files_are_refused_with_one_line(change, expected, bring, tables, capsys, churn_entry):
    args, folder = bring("logistic")
    churn_entry.preprocessing.save(folder / "churn.json")
    (folder / "garbage.onnx").write_bytes(b"not a model")
    tables["calibration"].drop(columns=["Status"]).to_csv(folder / "no-target.csv", index=False)
    tables["calibration"].head(49).to_csv(folder / "few.csv", index=False)
    tables["calibration"].assign(Branch="north").to_csv(folder / "extra.csv", index=False)
    (folder / "calibration.xlsx").write_bytes(b"PK")
    code = cli.main(change(args, folder))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert expected.format(f=folder) in err
    assert not (folder / "models").exists()


def test_missing_files_are_named(bring, capsys):
    args, folder = bring("logistic")
    (folder / "preprocessing.json").unlink()
    assert cli.main(args) == 2
    assert capsys.readouterr().err == f"mlpair import-model: no such file: --preprocessing {folder / 'preprocessing.json'}\n"


def test_the_churn_schema_is_not_the_credit_preprocessing(bring, capsys):
    args, folder = bring("logistic")
    args[args.index(str(CREDIT_SCHEMA))] = str(CHURN_SCHEMA)
    assert cli.main(args) == 2
    assert "was fitted for feature schema 'credit-risk/v1' of 'credit-risk'" in capsys.readouterr().err
