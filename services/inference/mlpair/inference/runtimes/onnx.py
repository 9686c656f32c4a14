"""ONNX Runtime backend: one InferenceSession per model version."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from mlpair.inference.errors import ModelLoadFailed
from mlpair.inference.placement import DISABLE_CPU_FALLBACK, measure_placement
from mlpair.startup import StartupError

logger = logging.getLogger(__name__)

OPT_LEVELS = {
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
        ModelLoadFailed: on CUDA, some node would run on the CPU execution provider (the message names
            the op types).

    On CUDA (``provider="cuda"``, or "auto" where this build has CUDA) the session is built with
    ``session.disable_cpu_ep_fallback`` = "1", so ONNX Runtime refuses a model with any node it would
    place on the CPU rather than run it partly there (:mod:`mlpair.inference.placement`); CPU
    sessions are built as before.

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
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPT_LEVELS[graph_optimization])
        options.use_deterministic_compute = deterministic
        providers = choose_providers(provider, ort.get_available_providers())
        if providers[0] == "CUDAExecutionProvider":
            self._session = self._strict_session(model_path, provider, graph_optimization, options, ort)
        else:
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

    @staticmethod
    def _strict_session(
        model_path: Path, provider: str, graph_optimization: str, options, ort, target: str = "CUDAExecutionProvider"
    ):
        """A session on ``target`` in which no node runs on the CPU provider; when ``target`` itself did
        not start, a CPU session for ``provider="auto"`` and a refusal otherwise.

        Raises:
            ModelLoadFailed: ``target`` runs, but some nodes would not; the message names their op types.
            StartupError: ``provider="cuda"`` and the CUDA provider did not start.
        """
        options.add_session_config_entry(DISABLE_CPU_FALLBACK, "1")
        try:
            # ONNX Runtime adds the CPU provider itself (for its copies); listing it conflicts with the option
            return ort.InferenceSession(str(model_path), options, providers=[target])
        except Exception as exc:
            if "fallback to CPU EP has been explicitly disabled" not in str(exc):
                raise
        # Refused: either some node has no CUDA kernel, or CUDA did not start and everything is on CPU.
        try:
            report = measure_placement(model_path, target, graph_optimization=graph_optimization)
        except Exception as exc:  # noqa: BLE001  (the refusal stands; only its detail is missing)
            logger.warning("placement of %s could not be measured (%s)", model_path, type(exc).__name__)
            report = None
        if report is None or report.session_providers[:1] == [target]:
            on_cpu = [n for n in report.nodes if n.provider != report.target] if report else []
            raise ModelLoadFailed(
                f"{model_path}: with {target} ONNX Runtime would run "
                + (
                    f"{len(on_cpu)} node(s) on the CPU (op types: {', '.join(report.fallback_op_types())})"
                    if report and on_cpu
                    else "some nodes on the CPU"
                )
                + "; refused rather than served partly on the CPU: `mlpair check-model --provider cuda` lists "
                "each node's placement"
            )
        if provider == "cuda":
            raise StartupError(
                f"execution_provider=cuda but ONNX Runtime's CUDA execution provider did not start (the "
                f"session runs on {report.session_providers[0]}; its CUDA libraries or the GPU driver are "
                f"missing or of another CUDA major): {CUDA_FIX}"
            )
        cpu = ort.SessionOptions()
        cpu.intra_op_num_threads = options.intra_op_num_threads
        cpu.inter_op_num_threads = 1
        cpu.graph_optimization_level = options.graph_optimization_level
        cpu.use_deterministic_compute = options.use_deterministic_compute
        return ort.InferenceSession(str(model_path), cpu, providers=["CPUExecutionProvider"])

    def run(self, features: np.ndarray) -> np.ndarray:
        """Logits for ``features`` ``[batch, n_features] float32`` (blocking; call from an executor)."""
        return self._session.run([self._output], {self._input: features})[0]

    def device_memory_bytes(self) -> int | None:
        """Always None: ONNX Runtime reports no device memory per session."""
        return None  # ONNX Runtime exposes no per-session device memory figure
