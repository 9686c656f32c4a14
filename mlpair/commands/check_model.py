"""``mlpair check-model``: where each node of a model would run on a target execution provider, before
the model is published (:mod:`mlpair.inference.placement`)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

PLACEMENT_OK, PLACEMENT_FALLBACK, PROVIDER_MISSING = 0, 1, 2


@dataclass
class TorchCheck:
    """The exported PyTorch program beside the ONNX model, moved to the target device."""

    checked: bool
    note: str
    stray: list[str]
    """Parameters and buffers not on the target device after ``.to(device)``."""


def check_torch_program(program: Path, provider: str) -> TorchCheck:
    """Loads the exported program (``torch.export``), moves it to ``provider``'s device and lists the
    parameters and buffers that are elsewhere. Not checked (with why) without torch or, for cuda,
    without a CUDA device torch can use."""
    try:
        import torch
    except ImportError:
        return TorchCheck(False, "torch is not installed: the exported program was not checked", [])
    if provider == "cuda" and not torch.cuda.is_available():
        return TorchCheck(False, "torch sees no CUDA device: the exported program was not checked", [])
    device = torch.device("cuda" if provider == "cuda" else "cpu")
    module = torch.export.load(str(program)).module().to(device)
    tensors = [*module.named_parameters(), *module.named_buffers()]
    stray = [f"{name} ({t.device})" for name, t in tensors if t.device.type != device.type]
    return TorchCheck(True, f"{len(tensors)} parameters and buffers on {device}" if not stray else "", stray)


def _entries(root: Path, model: str | None, version: str | None) -> list[Path]:
    """The repository folders to check: each model's latest version, or the one named.

    Raises:
        FileNotFoundError: the repository, model or version does not exist (the message says which).
    """
    from mlpair.contracts.manifest import list_versions

    if not root.is_dir():
        raise FileNotFoundError(f"no model repository at {root}: pass --model-repository")
    names = [model] if model else sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    folders = []
    for name in names:
        versions = [str(v) for v in list_versions(root, name)]
        if not versions:
            raise FileNotFoundError(f"no version of model {name!r} under {root}")
        if version and version not in versions:
            raise FileNotFoundError(
                f"model {name!r} has no version {version} under {root} (it has {', '.join(versions)})"
            )
        folders.append(root / name / (version or versions[-1]))
    return folders


def check_model(args: argparse.Namespace) -> int:
    """``mlpair check-model``: for each model version, builds an ONNX Runtime session for the target
    provider with profiling on, runs one batch and prints where each node ran; checks the exported
    PyTorch program's parameters and buffers on the target device too.

    Returns:
        0 when every node runs on the target provider (and the torch program, where checked, is wholly
        on its device), 1 when some would run elsewhere (the op types are listed), 2 when the target
        provider is not in this ONNX Runtime build, or the repository, model or version is missing
        (one line on stderr saying what to install or pass).
    """
    from rich.console import Console
    from rich.table import Table

    from mlpair.contracts.manifest import load_entry
    from mlpair.inference.placement import PROVIDERS, ProviderMissing, measure_placement

    target = PROVIDERS[args.provider]
    try:
        folders = _entries(Path(args.model_repository), args.model, args.version)
    except FileNotFoundError as exc:
        print(f"mlpair check-model: {exc}", file=sys.stderr)
        return PROVIDER_MISSING
    console = Console(highlight=False)
    status = PLACEMENT_OK
    for folder in folders:
        entry = load_entry(folder)
        name, version = entry.manifest.model_name, entry.manifest.model_version
        try:
            report = measure_placement(entry.model_path, target, graph_optimization=args.graph_optimization)
        except ProviderMissing as exc:
            print(f"mlpair check-model: {exc}", file=sys.stderr)
            return PROVIDER_MISSING
        table = Table(title=f"{name} version {version}: {entry.manifest.model_file} on {target}")
        table.add_column("provider")
        table.add_column("nodes", justify="right")
        table.add_column("op types (nodes)")
        for provider, ops in sorted(report.by_provider().items()):
            table.add_row(
                provider + ("" if provider == target else "  (fallback)"),
                str(sum(ops.values())),
                ", ".join(f"{op} ({n})" for op, n in sorted(ops.items())),
            )
        console.print(table)
        if report.all_on_target:
            console.print(f"{name} {version}: all {len(report.nodes)} nodes on {target}")
        else:
            status = PLACEMENT_FALLBACK
            console.print(
                f"{name} {version}: {sum(n.provider != target for n in report.nodes)} of {len(report.nodes)} "
                f"nodes would not run on {target}; op types: {', '.join(report.fallback_op_types()) or 'none ran'}"
            )
        if entry.manifest.torch_program:
            torch_check = check_torch_program(entry.path / entry.manifest.torch_program, args.provider)
            if torch_check.stray:
                status = PLACEMENT_FALLBACK
                console.print(
                    f"{name} {version}: exported program has {len(torch_check.stray)} tensor(s) off the "
                    f"target device: {', '.join(torch_check.stray)}"
                )
            else:
                console.print(f"{name} {version}: {entry.manifest.torch_program}: {torch_check.note}")
    return status
