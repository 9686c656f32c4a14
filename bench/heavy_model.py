"""A compute-heavy variant of the credit-risk model, as a real repository entry.

Same input (``[batch, n_features] float32``, the real model's feature schema, preprocessing
and version triple) and output (logits ``[batch, 2] float32``), but a wide MLP in between:
``n_features → 1024 → 1024 → 1024 → 2`` (~2.1 M parameters, ReLU, He-scaled random weights
from a fixed seed). One row costs ~0.2–1 ms of ONNX Runtime CPU time on one thread, and a
128-row batch several times less per row, so this is where dynamic batching shows. The
weights are not trained: the benchmark measures serving, not the model's quality.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

HEAVY_SUFFIX = "-heavy"
HIDDEN = (1024, 1024, 1024)


def build_onnx(n_features: int, n_classes: int, hidden: tuple[int, ...] = HIDDEN, seed: int = 20261130) -> bytes:
    """Serialized ONNX (opset 17) of the wide MLP: input ``features``, output ``logits``."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    dims = [n_features, *hidden, n_classes]
    nodes, weights = [], []
    previous = "features"
    for i, (fan_in, fan_out) in enumerate(zip(dims, dims[1:])):
        last = i == len(dims) - 2
        w = (rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        bias = np.zeros(fan_out, np.float32)
        weights += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(bias, f"b{i}")]
        out = "logits" if last else f"h{i}"
        nodes.append(helper.make_node("Gemm", [previous, f"w{i}", f"b{i}"], [out if last else f"z{i}"]))
        if not last:
            nodes.append(helper.make_node("Relu", [f"z{i}"], [out]))
        previous = out
    graph = helper.make_graph(
        nodes, "credit_risk_heavy",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", n_features])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", n_classes])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def write_heavy_entry(source: Path, root: Path) -> Path:
    """Writes ``<root>/<model>-heavy/1/`` from the real entry at ``source`` and returns it.

    The manifest, preprocessing and version triple are the real model's (so the same rows and
    ``x-feature-version`` apply); ``model.onnx`` and its hash are the heavy network's. The
    torch program is dropped (the ONNX runtime serves it).
    """
    from mlpair.contracts.manifest import file_sha256, load_entry

    entry = load_entry(source)
    manifest = entry.manifest
    target = root / f"{manifest.model_name}{HEAVY_SUFFIX}" / "1"
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    shutil.copy(source / "preprocessing.json", target / "preprocessing.json")
    (target / "model.onnx").write_bytes(build_onnx(manifest.n_features, len(manifest.class_names)))
    data = json.loads((source / "manifest.json").read_text())
    data["model_name"] = f"{manifest.model_name}{HEAVY_SUFFIX}"
    data["versions"]["model_version"] = "1"
    data["model_file"] = "model.onnx"
    data["model_sha256"] = file_sha256(target / "model.onnx")
    data["torch_program"] = data["torch_program_sha256"] = None
    (target / "manifest.json").write_text(json.dumps(data, indent=2) + "\n")
    return load_entry(target).path
