"""A model repository entry whose logits are non-finite for some inputs (C09, C43).

The entry is the session's real credit-risk model with three nodes appended to its ONNX graph:
the logits pass through bit for bit unless the standardised ``Age`` column exceeds the value an
applicant of 95 years gets, where they become NaN. Warm-up runs zeros (the training mean), so the
entry loads and warms up cleanly; its manifest is the real one with the new file's hash. An
applicant is made "bad" by :func:`bad` (Age 99); every real holdout applicant is younger.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from mlpair.contracts.assembly import FeatureAssembler
from mlpair.contracts.manifest import MANIFEST_FILE, ModelEntry, file_sha256

TRIGGER = "Age"
THRESHOLD_AGE = 95
BAD_AGE = 99


def bad(record: dict) -> dict:
    """``record`` with the attribute that makes this entry's logits NaN."""
    return {**record, TRIGGER: BAD_AGE}


def threshold(entry: ModelEntry) -> tuple[int, float]:
    """(column of the trigger in the feature vector, the standardised value of Age 95)."""
    column = entry.preprocessing.feature_names.index(TRIGGER)
    row = FeatureAssembler(entry.preprocessing).assemble({TRIGGER: THRESHOLD_AGE}).vector
    return column, float(row[column])


def write_entry(source: ModelEntry, root: Path, model: str = "credit-risk", version: str = "1") -> Path:
    """Writes ``root/model/version``: ``source`` with NaN logits past the trigger.

    Returns:
        The entry's folder.
    """
    import onnx
    from onnx import TensorProto, helper

    column, limit = threshold(source)
    graph_model = onnx.load(source.model_path)
    graph = graph_model.graph
    input_name = graph.input[0].name
    output = graph.output[0]
    inner = output.name + "_raw"
    for node in graph.node:  # the old output becomes an inner value that the new nodes read
        node.output[:] = [inner if name == output.name else name for name in node.output]
    graph.initializer.extend([
        helper.make_tensor("trigger_column", TensorProto.INT64, [1], [column]),
        helper.make_tensor("trigger_limit", TensorProto.FLOAT, [], [limit]),
        helper.make_tensor("nan", TensorProto.FLOAT, [], [float("nan")]),
    ])
    graph.node.extend([
        helper.make_node("Gather", [input_name, "trigger_column"], ["trigger_value"], axis=1),  # [batch, 1]
        helper.make_node("Greater", ["trigger_value", "trigger_limit"], ["triggered"]),
        helper.make_node("Where", ["triggered", "nan", inner], [output.name]),
    ])
    onnx.checker.check_model(graph_model)
    target = root / model / version
    target.mkdir(parents=True)
    for name in ("preprocessing.json",):
        shutil.copy(source.path / name, target / name)
    model_file = target / source.manifest.model_file
    onnx.save(graph_model, model_file)
    manifest = json.loads((source.path / MANIFEST_FILE).read_text())
    manifest.update(model_sha256=file_sha256(model_file), torch_program=None, torch_program_sha256=None)
    (target / MANIFEST_FILE).write_text(json.dumps(manifest))
    return target


def repository(credit: ModelEntry, churn: ModelEntry | None, root: Path) -> Path:
    """A repository with the non-finite credit-risk entry (and the real churn model, when given)."""
    write_entry(credit, root)
    if churn is not None:
        shutil.copytree(churn.path, root / "churn" / churn.path.name)
    return root


def triggers(entry: ModelEntry, x: np.ndarray) -> np.ndarray:
    """Which rows of ``x`` ``[n, n_features] float32`` get NaN logits from this entry."""
    column, limit = threshold(entry)
    return x[:, column] > np.float32(limit)
