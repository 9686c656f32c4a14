"""Model runtimes: one object per loaded model version that turns features into logits.

Every runtime has the same small surface (:class:`Runtime`), so the batcher and the engine
never know which one runs. :func:`create_runtime` picks one from the settings; importing
this package imports neither onnxruntime nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from mlpair.contracts.manifest import ModelEntry
    from mlpair.inference.settings import InferenceSettings


class Runtime(Protocol):
    """What the batcher needs from a backend."""

    description: str
    """Backend and device, e.g. ``"onnxruntime:CPUExecutionProvider"``."""
    platform: str
    """OIP platform name, e.g. ``"onnxruntime_onnx"`` or ``"pytorch_torchexport"``."""

    def run(self, features: np.ndarray) -> np.ndarray:
        """Logits ``[batch, n_classes] float32`` for ``features`` ``[batch, n_features] float32``.

        Blocking; the batcher calls it from its executor, one batch at a time per instance.
        """

    def device_memory_bytes(self) -> int | None:
        """Accelerator memory held by this model, or None on CPU / when unknown."""


def create_runtime(entry: ModelEntry, settings: InferenceSettings) -> Runtime:
    """The runtime ``settings.runtime`` names, loaded from ``entry``'s files.

    Raises:
        ModelLoadFailed: the entry has no file for that runtime.
        Exception: whatever the backend raises while loading (the repository logs it).
    """
    if settings.runtime == "torch":
        from mlpair.inference.errors import ModelLoadFailed
        from mlpair.inference.runtimes.torch import TorchRuntime

        program = entry.manifest.torch_program
        if not program:
            raise ModelLoadFailed(
                f"{entry.manifest.model_name} version {entry.manifest.model_version} has no "
                "exported PyTorch program; retrain it or use runtime=onnx"
            )
        return TorchRuntime(
            entry.path / program,
            device=settings.execution_provider,
            threads=settings.intra_op_threads,
            half_precision=settings.half_precision,
            cuda_graphs=settings.cuda_graphs,
            deterministic=settings.deterministic,
            graph_batch_sizes=warmup_batch_sizes(settings),
        )
    from mlpair.inference.runtimes.onnx import OnnxRuntime

    return OnnxRuntime(
        entry.model_path,
        provider=settings.execution_provider,
        intra_op_threads=settings.intra_op_threads,
        graph_optimization=settings.graph_optimization,
        deterministic=settings.deterministic,
    )


def warmup_batch_sizes(settings: InferenceSettings) -> list[int]:
    """Batch sizes the warm-up runs (and CUDA graphs capture): 1, the preferred sizes and max."""
    return sorted({1, *settings.preferred_batch_sizes, settings.max_batch_size})
