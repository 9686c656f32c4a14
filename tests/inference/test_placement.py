"""Operator placement (mlpair.inference.placement, `mlpair check-model`) and the refusal of a CUDA
session with nodes on the CPU (mlpair.inference.runtimes.onnx), on this machine's ONNX Runtime.

This build has no CUDA provider. Where a test needs a target provider that cannot run the model's
nodes, ONNX Runtime's Azure execution provider (in every PyPI build; it runs no standard operator)
stands in for a CUDA build without kernels for them: ONNX Runtime assigns every node to the CPU, as it
assigns the nodes CUDA lacks."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from mlpair.cli import main
from mlpair.inference.errors import ModelLoadFailed
from mlpair.inference.placement import DISABLE_CPU_FALLBACK, PROVIDERS, measure_placement, parse_profile
from mlpair.inference.runtimes.onnx import OnnxRuntime

NO_KERNELS = "AzureExecutionProvider"
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.fixture(scope="module")
def onnx_model(credit_entry) -> Path:
    return credit_entry.model_path


def test_the_profile_parser_reads_every_node_of_a_real_cpu_profile(onnx_model, tmp_path):
    # ONNX Runtime's own profile of one run, without graph optimisation: the nodes are the model's
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "run")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(onnx_model), options, providers=["CPUExecutionProvider"])
    features = session.get_inputs()[0]
    session.run(None, {features.name: np.zeros((2, features.shape[1]), np.float32)})
    events = json.loads(Path(session.end_profiling()).read_text())
    report = parse_profile(events, "CPUExecutionProvider", session.get_providers())
    graph = onnx.load(str(onnx_model)).graph.node
    assert Counter(n.op_type for n in report.nodes) == Counter(n.op_type for n in graph)
    assert {n.provider for n in report.nodes} == {"CPUExecutionProvider"} and report.all_on_target
    # the same events twice (two runs) count each node once
    assert len(parse_profile(events + events, "CPUExecutionProvider", []).nodes) == len(graph)
    with pytest.raises(ValueError, match="JSON list"):
        parse_profile({"traceEvents": []}, "CPUExecutionProvider", [])


def test_nodes_a_target_cannot_run_are_reported_as_falling_back(onnx_model):
    on_cpu = measure_placement(onnx_model, "CPUExecutionProvider")
    assert on_cpu.all_on_target and on_cpu.fallback_op_types() == []
    elsewhere = measure_placement(onnx_model, NO_KERNELS)
    assert not elsewhere.all_on_target
    assert elsewhere.session_providers[0] == NO_KERNELS  # the provider started; the nodes went to the CPU
    assert elsewhere.fallback_op_types() == sorted({n.op_type for n in on_cpu.nodes})
    assert elsewhere.by_provider() == {"CPUExecutionProvider": Counter(n.op_type for n in on_cpu.nodes)}


def test_a_strict_session_refuses_a_model_with_nodes_on_the_cpu_naming_their_op_types(onnx_model):
    options = ort.SessionOptions()
    with pytest.raises(ModelLoadFailed) as refused:
        OnnxRuntime._strict_session(onnx_model, "auto", "all", options, ort, target=NO_KERNELS)
    assert options.get_session_config_entry(DISABLE_CPU_FALLBACK) == "1"
    op_types = ", ".join(sorted({n.op_type for n in measure_placement(onnx_model, "CPUExecutionProvider").nodes}))
    message = refused.value.message
    assert f"(op types: {op_types})" in message and "\n" not in message
    assert "mlpair check-model --provider cuda" in message


def test_cpu_sessions_are_built_without_the_strict_option(onnx_model):
    runtime = OnnxRuntime(onnx_model, provider="cpu")
    with pytest.raises(RuntimeError, match="does not have configuration"):
        runtime._session.get_session_options().get_session_config_entry(DISABLE_CPU_FALLBACK)


def test_check_model_for_cpu_passes_every_node_and_the_torch_program(model_repository, capsys):
    assert (
        main(
            ["check-model", "--provider", "cpu", "--model-repository", str(model_repository), "--model", "credit-risk"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "credit-risk 1: all " in out and " nodes on CPUExecutionProvider" in out
    assert "model.pt2:" in out and "parameters and buffers on cpu" in out


@pytest.mark.skipif(HAS_CUDA, reason="this ONNX Runtime has the CUDA provider")
def test_check_model_for_cuda_without_the_provider_exits_2_with_one_line(model_repository, capsys):
    assert main(["check-model", "--provider", "cuda", "--model-repository", str(model_repository)]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("mlpair check-model: CUDAExecutionProvider is not in this ONNX Runtime build")
    assert "install onnxruntime-gpu" in line and captured.out == ""


def test_check_model_exits_1_listing_op_types_when_nodes_fall_back(model_repository, monkeypatch, capsys):
    monkeypatch.setitem(PROVIDERS, "cuda", NO_KERNELS)  # a provider present but without the kernels
    assert (
        main(
            ["check-model", "--provider", "cuda", "--model-repository", str(model_repository), "--model", "credit-risk"]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "nodes would not run on AzureExecutionProvider; op types: " in out
    assert "(fallback)" in out


def test_check_model_names_a_missing_version(model_repository, capsys):
    assert (
        main(
            [
                "check-model",
                "--provider",
                "cpu",
                "--model-repository",
                str(model_repository),
                "--model",
                "credit-risk",
                "--version",
                "999",
            ]
        )
        == 2
    )
    assert "has no version 999" in capsys.readouterr().err
