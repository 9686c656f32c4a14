"""ONNX Runtime backend: one InferenceSession per model version."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from mlpair.startup import StartupError

logger = logging.getLogger(__name__)

_OPT_LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}


CUDA_FIX = (
    "install an onnxruntime-gpu built for this node's CUDA major (pyproject's inference-gpu extra) "
    "on a node with an NVIDIA driver, or set INFERENCE_EXECUTION_PROVIDER=auto to allow CPU"
)


def choose_providers(requested: str, available: list[str]) -> list[str]:
    """Execution providers to use for ``requested`` ("auto", "cuda" or "cpu").

    "auto" takes CUDA when this ONNX Runtime build has it, else CPU (logged). "cuda" insists.

    Raises:
        StartupError: "cuda" and this ONNX Runtime build has no CUDA execution provider.
    """
    if requested in ("auto", "cuda") and "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if requested == "cuda":
        raise StartupError(
            f"execution_provider=cuda but this ONNX Runtime has no CUDA execution provider "
            f"(it has {', '.join(available)}): {CUDA_FIX}"
        )
    if requested == "auto":
        logger.info("no CUDA execution provider in this ONNX Runtime build; using CPU")
    return ["CPUExecutionProvider"]


class OnnxRuntime:
    """Runs an ONNX model: ``[batch, n_features] float32`` → logits ``[batch, n_classes] float32``.

    Raises (at construction):
        StartupError: ``provider="cuda"`` and the CUDA execution provider is not active in the session.

    Deterministic mode sets ``use_deterministic_compute`` (on CUDA: deterministic kernels only,
    no cuDNN autotuning) and one intra-op thread; on CPU with one thread ONNX Runtime is already
    deterministic, so the cost there is nil, on CUDA it can be a few percent to 2x on conv-heavy
    models (none for this MLP).
    """

    platform = "onnxruntime_onnx"

    def __init__(
        self,
        model_path: Path,
        *,
        provider: str = "auto",
        intra_op_threads: int = 1,
        graph_optimization: str = "all",
        deterministic: bool = False,
    ) -> None:
        import onnxruntime as ort  # imported here so importing the service never needs it

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1 if deterministic else intra_op_threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _OPT_LEVELS[graph_optimization])
        options.use_deterministic_compute = deterministic
        providers = choose_providers(provider, ort.get_available_providers())
        self._session = ort.InferenceSession(str(model_path), options, providers=providers)
        self._input = self._session.get_inputs()[0].name
        self._output = self._session.get_outputs()[0].name
        self.provider = self._session.get_providers()[0]
        if providers[0] != self.provider:  # e.g. the CUDA libraries are missing on this node
            if provider == "cuda":  # ORT only logs this and runs on CPU: refuse instead
                raise StartupError(
                    f"execution_provider=cuda but ONNX Runtime's CUDA execution provider did not "
                    f"start (the session runs on {self.provider}; its CUDA libraries or the GPU "
                    f"driver are missing or of another CUDA major): {CUDA_FIX}"
                )
            logger.warning("%s could not start; ONNX Runtime fell back to %s", providers[0], self.provider)
        self.description = f"onnxruntime:{self.provider}"
        logger.info("loaded %s with %s", model_path, self.provider)

    def run(self, features: np.ndarray) -> np.ndarray:
        """Logits for ``features`` ``[batch, n_features] float32`` (blocking; call from an executor)."""
        return self._session.run([self._output], {self._input: features})[0]

    def device_memory_bytes(self) -> int | None:
        return None  # ONNX Runtime exposes no per-session device memory figure
