"""ONNX export with a dynamic batch dimension, checked against PyTorch before it is kept."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from mlpair.training.model import MLPClassifier, predict_logits

INPUT_NAME = "features"
OUTPUT_NAME = "logits"
OPSET = 17
PARITY_TOLERANCE = 1e-4  # max |logit difference| allowed between ONNX Runtime and PyTorch


class ExportParityError(RuntimeError):
    """ONNX Runtime and PyTorch disagree on the holdout by more than PARITY_TOLERANCE."""


def export_onnx(model: MLPClassifier, n_features: int, path: Path) -> None:
    """Writes the model as ONNX: input ``features`` [batch, n_features] FP32 → ``logits`` [batch, 2]."""
    with warnings.catch_warnings():
        # The TorchScript exporter is deprecated in favour of torch.export, which needs
        # onnxscript; this small static graph exports identically either way.
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (torch.zeros(1, n_features),),
            str(path),
            dynamo=False,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            opset_version=OPSET,
            dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
        )


def export_torch_program(model: MLPClassifier, n_features: int, path: Path) -> None:
    """Writes a ``torch.export`` program (dynamic batch) for the PyTorch serving runtime."""
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    # An example batch of 8: torch.export specialises sizes 0 and 1, which would pin the batch.
    program = torch.export.export(model.eval(), (torch.zeros(8, n_features),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))


def check_parity(model: MLPClassifier, path: Path, x: np.ndarray) -> float:
    """Max |ONNX Runtime − PyTorch| logit difference on ``x`` ``[n, n_features] float32``.

    Raises:
        ExportParityError: the difference exceeds PARITY_TOLERANCE.
    """
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ort_logits = session.run([OUTPUT_NAME], {INPUT_NAME: x})[0]
    diff = float(np.max(np.abs(ort_logits - predict_logits(model, x))))
    if not diff <= PARITY_TOLERANCE:
        raise ExportParityError(f"ONNX Runtime logits differ from PyTorch by {diff:.3g} > {PARITY_TOLERANCE}")
    return diff
