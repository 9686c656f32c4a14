"""PyTorch backend for the GPU pool: runs the ``torch.export`` program saved beside model.onnx.

The program (``model.pt2``, written by training and recorded in the manifest) is
self-contained: serving needs no model class. Every call runs under ``torch.inference_mode``.
On CUDA it can run in half precision and replay CUDA graphs captured per warm-up batch size
(a batch is zero-padded up to the smallest captured size that holds it; rows of this MLP are
independent, so padding never changes a real row's logits). On CPU both options are ignored
with a log line.

Deterministic mode: ``torch.use_deterministic_algorithms(True)``, a fixed seed, cuDNN
autotuning off, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, one CPU thread, and every batch run at
one fixed size (zero-padded to the largest warm-up batch size, longer batches in chunks of it).
Deterministic kernels alone give the same logits for the same batch twice, not for the same
row in batches of different sizes: the GEMM libraries pick a different blocking, and so a
different summation order, per batch size (measured with ``bench/gpu_check.py``: up to 5e-7 apart
on CPU). One fixed shape makes a row's logits independent of its batch and its batch-mates.
Its cost is the speed of the kernels it rules out plus the padded rows; it is for audited
deployments that must replay a decision exactly.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np

from mlpair.startup import StartupError

logger = logging.getLogger(__name__)

DETERMINISTIC_SEED = 0


class TorchRuntime:
    """Runs an exported program: ``[batch, n_features] float32`` → logits ``[batch, n_classes] float32``."""

    platform = "pytorch_torchexport"

    def __init__(
        self,
        program_path: Path,
        *,
        device: str = "auto",
        threads: int = 1,
        half_precision: bool = False,
        cuda_graphs: bool = False,
        deterministic: bool = False,
        graph_batch_sizes: list[int] | None = None,
    ) -> None:
        import torch  # only this runtime needs torch

        self._torch = torch
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call
            torch.manual_seed(DETERMINISTIC_SEED)
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.benchmark = False
            threads = 1
        torch.set_num_threads(threads)  # process-wide: one setting for every torch model here
        self.device = self._choose_device(device)
        self._half = half_precision and self.device.type == "cuda"
        if half_precision and not self._half:
            logger.info("half_precision ignored: it needs CUDA")
        module = torch.export.load(str(program_path)).module().to(self.device)
        self._module = module.half() if self._half else module
        self._graphs: dict[int, tuple] = {}
        self._graph_lock = threading.Lock()  # a graph's static buffers serve one batch at a time
        self._fixed_rows = max(graph_batch_sizes or [1]) if deterministic else 0
        """Deterministic mode: every batch runs at this many rows (zero-padded, chunked); 0 = as it comes."""
        if cuda_graphs and self.device.type == "cuda":
            self._capture([self._fixed_rows] if self._fixed_rows else graph_batch_sizes or [1])
        elif cuda_graphs:
            logger.info("cuda_graphs ignored: it needs CUDA")
        self.description = f"torch:{self.device}{':fp16' if self._half else ''}{':cudagraphs' if self._graphs else ''}"
        logger.info("loaded %s on %s", program_path, self.description)

    def _choose_device(self, requested: str):
        torch = self._torch
        if requested in ("auto", "cuda") and torch.cuda.is_available():
            return torch.device("cuda")
        if requested == "cuda":
            raise StartupError(
                "execution_provider=cuda but torch sees no usable GPU (torch.cuda.is_available() is "
                "false: no driver, no device, or a torch build without CUDA): run on a GPU node with "
                "a CUDA build of torch, or set INFERENCE_EXECUTION_PROVIDER=auto to allow CPU"
            )
        return torch.device("cpu")

    def _capture(self, sizes: list[int]) -> None:
        """Captures one CUDA graph per batch size (PyTorch's recipe: warm up on a side stream)."""
        torch = self._torch
        n_features = None
        for size in sorted(sizes):
            if n_features is None:
                n_features = self._probe_features()
            dtype = torch.float16 if self._half else torch.float32
            static_in = torch.zeros((size, n_features), dtype=dtype, device=self.device)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(3):
                    self._module(static_in)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), torch.inference_mode():
                static_out = self._module(static_in)
            self._graphs[size] = (graph, static_in, static_out)

    def _probe_features(self) -> int:
        """Input width, read from the first parameter the program holds (its first layer)."""
        for param in self._module.parameters():
            return int(param.shape[-1])
        raise ValueError("the exported program has no parameters to infer its input width from")

    def run(self, features: np.ndarray) -> np.ndarray:
        """Logits for ``features`` ``[batch, n_features] float32`` (blocking; call from an executor)."""
        if self._fixed_rows:
            return self._run_fixed(features)
        return self._run(features)

    def _run_fixed(self, features: np.ndarray) -> np.ndarray:
        """Deterministic mode: runs ``features`` in zero-padded chunks of exactly ``_fixed_rows`` rows."""
        size, rows = self._fixed_rows, features.shape[0]
        parts = []
        for start in range(0, max(rows, 1), size):
            chunk = features[start : start + size]
            padded = np.zeros((size, features.shape[1]), dtype=np.float32)
            padded[: chunk.shape[0]] = chunk
            parts.append(self._run(padded)[: chunk.shape[0]])
        return np.concatenate(parts)

    def _run(self, features: np.ndarray) -> np.ndarray:
        torch = self._torch
        if not features.flags.writeable:
            features = features.copy()  # torch refuses to wrap read-only memory without a warning
        rows = features.shape[0]
        with torch.inference_mode():
            x = torch.from_numpy(features)
            if self.device.type == "cuda":
                x = x.to(self.device, non_blocking=False)
            if self._half:
                x = x.half()
            graph_size = next((s for s in sorted(self._graphs) if s >= rows), None)
            if graph_size is not None:
                graph, static_in, static_out = self._graphs[graph_size]
                with self._graph_lock:
                    static_in.zero_()
                    static_in[:rows].copy_(x)
                    graph.replay()
                    return static_out[:rows].float().cpu().numpy()
            return self._module(x).float().cpu().numpy()

    def device_memory_bytes(self) -> int | None:
        """Bytes PyTorch's CUDA allocator holds on this runtime's device, or None on CPU.

        The figure is the whole process's on that device (every model and buffer allocated there), not
        this model's alone.
        """
        if self.device.type != "cuda":
            return None
        return int(self._torch.cuda.memory_allocated(self.device))
