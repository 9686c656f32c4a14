"""``mlpair import-model``: a model trained elsewhere (ONNX) made into a repository version like a trained one.

The model must take the feature vector this project builds from the schema (the preprocessing it
was trained on, ``preprocessing.json``): input ``[batch, n_features] float32``, output logits
``[batch, 2] float32`` whose column 1 is the schema's positive class. Steps: check the signature
against the preprocessing → keep only the logits output and name the tensors ``features`` and
``logits`` as a trained model's (the computation untouched; checked bit-identical on the
calibration rows) → fit the calibration on the user's calibration set with the training code
(:func:`~mlpair.training.pipeline.fit_calibration`) → write ``<root>/<model_name>/<version>/``
atomically with the version triple. Every refusal is an :class:`ImportRefused` of one line.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from mlpair.contracts import calibration, metrics
from mlpair.contracts.assembly import FeatureAssembler
from mlpair.contracts.manifest import (
    PREPROCESSING_FILE,
    SCORE_BASELINE,
    Manifest,
    ModelEntry,
    TensorSpec,
    VersionTriple,
    file_sha256,
    load_entry,
    write_manifest,
)
from mlpair.contracts.preprocessing import Preprocessing
from mlpair.contracts.schema import FeatureSchema
from mlpair.training.data import DataError, dataset_from_frame, read_table
from mlpair.training.export import INPUT_NAME, OUTPUT_NAME
from mlpair.training.pipeline import (
    baselines,
    fit_calibration,
    load_train_config,
    next_version_dir,
    score_baseline,
    staged_version,
)

MIN_CALIBRATION_ROWS = 50
N_CLASSES = 2
FLOAT = 1  # onnx.TensorProto.FLOAT
TABLE_KINDS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}


class ImportRefused(ValueError):
    """The model, its preprocessing or its calibration set cannot make a version; one line says why."""


def _dims(value_info) -> list[int | None]:
    """A tensor's shape: each dimension's size, None where it is symbolic or unknown."""
    return [
        d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
        for d in value_info.type.tensor_type.shape.dim
    ]


def describe(value_info) -> str:
    """``features [batch, 13] float32``: a graph input or output as refusals show it."""
    import onnx

    elem = value_info.type.tensor_type.elem_type
    kind = onnx.helper.tensor_dtype_to_np_dtype(elem).name if elem else "unknown type"
    dims = ", ".join(
        "batch" if d is None and i == 0 else "?" if d is None else str(d) for i, d in enumerate(_dims(value_info))
    )
    return f"{value_info.name} [{dims}] {kind}"


def check_signature(model, n_features: int, output: str | None = None) -> str:
    """Checks an ONNX graph against ``[batch, n_features] float32`` → ``[batch, 2] float32``.

    Args:
        output: the graph output holding the logits; None = the only one, or the only float32
            rank-2 output among several (scikit-learn's converters add an int64 ``label``).

    Returns:
        The name of the logits output.

    Raises:
        ImportRefused: naming what was expected and what the model has.
    """
    initializers = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in initializers]
    expected_in = f"one input [batch, {n_features}] float32"
    got_in = ", ".join(describe(i) for i in inputs) or "no input"
    if len(inputs) != 1:
        raise ImportRefused(f"model signature: expected {expected_in}, got {got_in}")
    dims = _dims(inputs[0])
    if inputs[0].type.tensor_type.elem_type != FLOAT or len(dims) != 2 or dims[0] is not None or dims[1] != n_features:
        raise ImportRefused(f"model signature: expected {expected_in} (a dynamic batch), got {got_in}")
    outputs = list(model.graph.output)
    if output is not None:
        chosen = [o for o in outputs if o.name == output]
        if not chosen:
            raise ImportRefused(
                f"model has no output {output!r}; its outputs: {', '.join(describe(o) for o in outputs)}"
            )
    else:
        floats = [o for o in outputs if o.type.tensor_type.elem_type == FLOAT and len(_dims(o)) == 2]
        chosen = outputs if len(outputs) == 1 else floats
        if len(chosen) != 1:
            raise ImportRefused(
                f"model has outputs {', '.join(describe(o) for o in outputs)}: pass --output naming the logits one"
            )
    out = chosen[0]
    dims = _dims(out)
    if (
        out.type.tensor_type.elem_type != FLOAT
        or len(dims) != 2
        or dims[1] not in (None, N_CLASSES)
        or dims[0] not in (None,)
    ):
        raise ImportRefused(
            f"model signature: expected output logits [batch, {N_CLASSES}] float32, got {describe(out)}"
        )
    return out.name


def _rename(graph, old: str, new: str) -> None:
    """Renames a tensor everywhere in a graph and its subgraphs."""
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.name == old:
            value.name = new
    for node in graph.node:
        node.input[:] = [new if n == old else n for n in node.input]
        node.output[:] = [new if n == old else n for n in node.output]
        for attr in node.attribute:
            for sub in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
                _rename(sub, old, new)


def _tensor_names(graph) -> set[str]:
    names = {v.name for v in (*graph.input, *graph.output, *graph.value_info, *graph.initializer)}
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
    return names


def as_served(model, output: str):
    """A copy of the graph with the logits output alone, the tensors named ``features`` and ``logits``.

    Raises:
        ImportRefused: the graph already uses one of those names for another tensor.
    """
    import onnx

    served = onnx.ModelProto()
    served.CopyFrom(model)
    graph = served.graph
    keep = [o for o in graph.output if o.name == output]
    del graph.output[:]
    graph.output.extend(keep)
    initializers = {t.name for t in graph.initializer}
    source_input = next(i.name for i in graph.input if i.name not in initializers)
    names = _tensor_names(graph)
    for old, new in ((source_input, INPUT_NAME), (output, OUTPUT_NAME)):
        if old != new and new in names:
            raise ImportRefused(
                f"model uses the name {new!r} for another tensor than its {'input' if new == INPUT_NAME else 'logits'}"
            )
        _rename(graph, old, new)
    onnx.checker.check_model(served)
    return served


def _run(model_bytes: bytes, input_name: str, output_name: str, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    return session.run([output_name], {input_name: x})[0]


def read_calibration_set(path: Path, schema: FeatureSchema):
    """The calibration table (``.csv`` or ``.parquet``, the schema's columns and target), checked as training data is.

    Raises:
        DataError: unreadable, or refused by :func:`~mlpair.training.data.check_table`.
    """
    kind = TABLE_KINDS.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"calibration set {path}: expected a .csv or .parquet file")
    frame = read_table(f"{kind}: {path}")
    return dataset_from_frame(
        frame, schema, f"calibration set {path}", min_rows=MIN_CALIBRATION_ROWS, allow_extra=False
    )


def import_model(
    model_path: Path,
    schema_path: Path,
    preprocessing_path: Path,
    calibration_path: Path,
    root: Path,
    *,
    output: str | None = None,
) -> ModelEntry:
    """Imports an ONNX model as the next version of the schema's model family under ``root``.

    Args:
        preprocessing_path: the fitted preprocessing the model's inputs were built with (``preprocessing.json``).
        calibration_path: rows the model never trained on, with the target (``.csv`` / ``.parquet``).
        output: the graph output holding the logits (see :func:`check_signature`).

    Returns:
        The written, verified entry.

    Raises:
        ImportRefused: a file is unreadable, the preprocessing belongs to another schema, the signature
            does not match, the outputs are not logits, or the calibration cannot be fitted.
        DataError: the calibration set is refused.
    """
    import onnx

    schema = FeatureSchema.from_toml(schema_path)
    try:
        preprocessing = Preprocessing.load(preprocessing_path)
    except (OSError, ValueError) as exc:
        raise ImportRefused(f"cannot read the preprocessing {preprocessing_path} ({type(exc).__name__})") from exc
    if preprocessing.feature_schema != schema:
        raise ImportRefused(
            f"preprocessing {preprocessing_path} was fitted for feature schema {preprocessing.feature_schema.version!r} "
            f"of {preprocessing.feature_schema.name!r}, not the one in {schema_path} ({schema.version!r}; the files differ)"
        )
    try:
        original = onnx.load_model(str(model_path))
    except Exception as exc:  # noqa: BLE001  (protobuf's DecodeError, OSError)
        raise ImportRefused(f"cannot read {model_path} as an ONNX model ({type(exc).__name__})") from exc
    logits_output = check_signature(original, preprocessing.n_features, output)
    served = as_served(original, logits_output)
    calib = read_calibration_set(calibration_path, schema)
    x = FeatureAssembler(preprocessing).assemble_many(calib.records)
    source_input = next(
        i.name for i in original.graph.input if i.name not in {t.name for t in original.graph.initializer}
    )
    logits = _run(served.SerializeToString(), INPUT_NAME, OUTPUT_NAME, x)
    if logits.shape != (len(x), N_CLASSES) or logits.dtype != np.float32:
        raise ImportRefused(
            f"model returned {logits.dtype} {list(logits.shape)} for {len(x)} rows; expected [{len(x)}, 2] float32"
        )
    if not np.array_equal(logits, _run(original.SerializeToString(), source_input, logits_output, x)):
        raise ImportRefused("the served copy of the graph computes other logits than the model itself")
    if bad := int((~np.isfinite(logits)).any(axis=1).sum()):
        raise ImportRefused(f"model returns non-finite logits for {bad} of {len(x)} calibration rows")
    if ((logits >= 0) & (logits <= 1)).all() and np.allclose(logits.sum(axis=1), 1.0, atol=1e-5):
        raise ImportRefused(
            f"output {logits_output!r} holds probabilities (each row sums to 1), not logits: export raw scores "
            "(skl2onnx: options raw_scores=True, zipmap=False) or pass --output naming the logits"
        )
    positive = 1
    ranking = metrics.roc_auc(calib.labels, calibration.margin(logits, positive))
    if not ranking >= 0.5:
        raise ImportRefused(
            f"model ranks the calibration set below chance (ROC AUC {ranking:.3f}): is logits column 1 "
            f"the positive class {schema.target.positive!r}?"
        )
    config = dataclasses.replace(load_train_config(schema_path), label_smoothing=0.0)
    try:
        cal = fit_calibration(logits, calib.labels, positive, config)
    except ValueError as exc:
        raise ImportRefused(f"calibration {config.calibration} cannot be fitted: {exc}") from exc
    probabilities = cal.probabilities(logits, positive)
    fitted = metrics.summary(calib.labels, probabilities)

    target = next_version_dir(root, schema.name)
    version = target.name
    with staged_version(target) as staging:
        onnx.save_model(served, str(staging / "model.onnx"))
        preprocessing.save(staging / PREPROCESSING_FILE)
        manifest = Manifest(
            model_name=schema.name,
            versions=VersionTriple(
                model_version=version, feature_schema_version=schema.version, preprocessing_hash=preprocessing.hash
            ),
            model_sha256=file_sha256(staging / "model.onnx"),
            inputs=[TensorSpec(name=INPUT_NAME, shape=[-1, preprocessing.n_features])],
            outputs=[TensorSpec(name=OUTPUT_NAME, shape=[-1, N_CLASSES])],
            class_names=[f"not {schema.target.positive}", schema.target.positive],
            positive_index=positive,
            calibration=cal.model_copy(update={"fitted_on": "imported calibration set"}),
            baselines={**baselines(preprocessing, calib), SCORE_BASELINE: score_baseline(probabilities)},
            metrics={
                "calibration_set_uncalibrated": metrics.summary(
                    calib.labels, cal.probabilities(logits, positive, "none")
                ),
                "calibration_set_calibrated": fitted,
            },
            data_source={
                "source": f"{TABLE_KINDS[calibration_path.suffix.lower()]}: {calibration_path.name}",
                "role": "calibration set of an imported model",
                "sha256": calib.sha256,
                "rows": len(calib.records),
                "target": f"{schema.target.column} == {schema.target.positive!r}",
            },
            training={
                "imported": {
                    "model_file": model_path.name,
                    "model_sha256": file_sha256(model_path),
                    "input": source_input,
                    "output": logits_output,
                },
                "calibration": config.calibration,
            },
        )
        write_manifest(staging, manifest)
    return load_entry(target)
