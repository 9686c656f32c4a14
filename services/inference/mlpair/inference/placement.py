"""Operator placement: which execution provider ONNX Runtime runs each node of a model on.

With the CUDA execution provider, ONNX Runtime assigns a node CUDA has no kernel for to the CPU
provider and says nothing (a warning at most): the session reports CUDA while part of the model runs
on the CPU, with a device-to-host copy on each side. Two defences use this module:

* at load (:mod:`mlpair.inference.runtimes.onnx`), a CUDA session is built with ONNX Runtime's
  ``session.disable_cpu_ep_fallback`` = "1" (``kOrtSessionOptionsDisableCPUEPFallback`` in
  onnxruntime_session_options_config_keys.h): session creation fails when any node is assigned to the
  CPU provider, shape computations ONNX Runtime deliberately keeps on the CPU included; the refusal
  then names the op types through :func:`measure_placement`;
* before a model is published, ``mlpair check-model --provider cuda`` reports the placement of every
  node (:func:`measure_placement`, rendered by :mod:`mlpair.commands.check_model`).

Placement is read from ONNX Runtime's own profiler: a session with ``enable_profiling`` runs one batch,
and each node event of the profile (Chrome trace format, ``cat`` "Node", name ``<node>_kernel_time``)
carries ``args.provider`` and ``args.op_name``. Nodes are those of the optimised graph, as they run
(e.g. a Gemm fused with its activation shows as ``FusedGemm``).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlpair.startup import StartupError

PROVIDERS = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}
"""Target names the command and settings use -> ONNX Runtime's execution provider names."""

INSTALL_HINT = {
    "CUDAExecutionProvider": "install onnxruntime-gpu built for the node's CUDA major (pyproject's inference-gpu extra) "
    "on a machine with an NVIDIA driver",
    "CPUExecutionProvider": "install onnxruntime (pyproject's inference extra)",
}

DISABLE_CPU_FALLBACK = "session.disable_cpu_ep_fallback"
"""ONNX Runtime's session option (``kOrtSessionOptionsDisableCPUEPFallback``): "1" refuses a session
in which any node is assigned to the CPU execution provider."""

_NUMPY_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}


class ProviderMissing(StartupError):
    """The target execution provider is not in this ONNX Runtime build (one line: what to install)."""


@dataclass(frozen=True)
class NodePlacement:
    """One node of the optimised graph and the provider that ran it."""

    name: str
    op_type: str
    provider: str


@dataclass
class PlacementReport:
    """Where each node ran, against the provider it should run on.

    Attributes:
        target: the execution provider every node should run on, e.g. ``"CUDAExecutionProvider"``.
        nodes: one entry per node that ran, in the order of the profile.
        session_providers: the session's providers (``InferenceSession.get_providers()``).
    """

    target: str
    nodes: list[NodePlacement]
    session_providers: list[str]

    def by_provider(self) -> dict[str, Counter[str]]:
        """Provider -> op type -> number of nodes."""
        out: dict[str, Counter[str]] = {}
        for node in self.nodes:
            out.setdefault(node.provider, Counter())[node.op_type] += 1
        return out

    def fallback_op_types(self) -> list[str]:
        """Op types of the nodes that ran elsewhere than the target, sorted."""
        return sorted({n.op_type for n in self.nodes if n.provider != self.target})

    @property
    def all_on_target(self) -> bool:
        """True when every node ran on the target provider (and some node ran)."""
        return bool(self.nodes) and not self.fallback_op_types()


def parse_profile(events: list[dict[str, Any]], target: str, session_providers: list[str]) -> PlacementReport:
    """The node placements of an ONNX Runtime profile (its JSON: a list of trace events).

    Each node appears once per run; a node seen in several runs is counted once.

    Raises:
        ValueError: ``events`` is not a list of trace events.
    """
    if not isinstance(events, list):
        raise ValueError("an ONNX Runtime profile is a JSON list of trace events")
    seen: dict[str, NodePlacement] = {}
    for event in events:
        if not isinstance(event, dict) or event.get("cat") != "Node":
            continue
        name, args = str(event.get("name", "")), event.get("args") or {}
        if not name.endswith("_kernel_time") or "provider" not in args:
            continue  # fence events (_fence_before/_fence_after) carry no placement
        node = name.removesuffix("_kernel_time")
        seen.setdefault(node, NodePlacement(node, str(args.get("op_name", "?")), str(args["provider"])))
    return PlacementReport(target, list(seen.values()), list(session_providers))


def _feeds(session: Any, rows: int) -> dict[str, np.ndarray]:
    """Zeros for every input, ``rows`` along each dimension the model leaves open.

    Raises:
        ValueError: an input type this check cannot make (e.g. strings).
    """
    feeds: dict[str, np.ndarray] = {}
    for item in session.get_inputs():
        dtype = _NUMPY_TYPES.get(item.type)
        if dtype is None:
            raise ValueError(f"input {item.name!r} has type {item.type}, which the placement check cannot make")
        shape = [d if isinstance(d, int) and d > 0 else rows for d in item.shape]
        feeds[item.name] = np.zeros(shape, dtype=dtype)
    return feeds


def measure_placement(
    model_path: Path,
    target: str,
    *,
    graph_optimization: str = "all",
    rows: int = 1,
    available: list[str] | None = None,
) -> PlacementReport:
    """Builds a session for ``target`` (CPU allowed as the fallback ONNX Runtime would use), runs one
    batch of zeros (``rows`` rows) with profiling on, and reports where each node ran.

    Args:
        model_path: the ONNX model.
        target: an execution provider name, e.g. ``"CUDAExecutionProvider"``.
        graph_optimization: as the service's setting (disable, basic, extended, all): placement is
            decided on the optimised graph, so check with the level the service runs.
        rows: batch size of the probe batch.
        available: the providers of this ONNX Runtime build (default: asked from it).

    Raises:
        ProviderMissing: ``target`` is not in this ONNX Runtime build.
        ValueError: the model has an input type this check cannot make.
        Exception: whatever ONNX Runtime raises loading or running the model.
    """
    import onnxruntime as ort

    from mlpair.inference.runtimes.onnx import OPT_LEVELS

    available = ort.get_available_providers() if available is None else available
    if target not in available:
        short = next((k for k, v in PROVIDERS.items() if v == target), target)
        raise ProviderMissing(
            f"{target} is not in this ONNX Runtime build ({ort.__version__}, providers: {', '.join(available)}): "
            f"{INSTALL_HINT.get(target, 'install an ONNX Runtime build with it')} to check placement for {short}"
        )
    providers = [target] if target == "CPUExecutionProvider" else [target, "CPUExecutionProvider"]
    with tempfile.TemporaryDirectory(prefix="mlpair-placement-") as folder:
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(folder, "profile")
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPT_LEVELS[graph_optimization])
        options.log_severity_level = 3  # errors only: the placement warning is what this reports
        session = ort.InferenceSession(str(model_path), options, providers=providers)
        session.run(None, _feeds(session, rows))
        profile = Path(session.end_profiling())
        events = json.loads(profile.read_text())
    return parse_profile(events, target, session.get_providers())
