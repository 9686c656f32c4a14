"""The inference image's CUDA check (deploy/docker/check_cuda_libs.py), on libraries built here.

No container engine runs here, so the image build itself (where the script checks the installed
onnxruntime-gpu's CUDA provider against the base image's CUDA) is not exercised; these tests
run the same script on stand-in libraries built with gcc: one linked to a CUDA runtime of the
wrong major is refused, one of the right major passes, a missing library is refused, and the
driver's libcuda.so.1 (mounted at run time, absent at build time) is allowed to be missing."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import deploy_checks as dc
import pytest

SCRIPT = dc.DEPLOY_DIR / "docker" / "check_cuda_libs.py"
pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("ldd") is None,
                                 reason="needs gcc and ldd to build stand-in CUDA libraries")]


def stub(directory: Path, soname: str) -> None:
    """A shared library named ``soname`` plus its link-time name (libcudart.so)."""
    source = directory / "stub.c"
    source.write_text("int stub_symbol(void) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(directory / soname), f"-Wl,-soname,{soname}", str(source)],
                   check=True, timeout=60)
    link = directory / soname.split(".so")[0]
    (directory / f"{link.name}.so").unlink(missing_ok=True)
    (directory / f"{link.name}.so").symlink_to(soname)


def provider(directory: Path, needs: list[str]) -> Path:
    """A stand-in for libonnxruntime_providers_cuda.so that needs each of ``needs`` (sonames)."""
    for soname in needs:
        stub(directory, soname)
    source = directory / "provider.c"
    source.write_text("int provider_symbol(void) { return 1; }\n")
    library = directory / "libonnxruntime_providers_cuda.so"
    libs = [f"-l{soname.split('.so')[0].removeprefix('lib')}" for soname in needs]
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source), "-Wl,--no-as-needed",
                    f"-L{directory}", f"-Wl,-rpath,{directory}", *libs], check=True, timeout=60)
    return library


def check(library: Path, cuda_major: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--library", str(library), "--cuda-major", str(cuda_major)],
                          capture_output=True, text=True, timeout=60)


def test_a_provider_linked_to_another_cuda_major_is_refused(tmp_path):
    library = provider(tmp_path, ["libcudart.so.13", "libcublas.so.13"])
    result = check(library, 12)
    assert result.returncode == 1
    assert "libcudart.so.13 is CUDA 13, the image has CUDA 12" in result.stderr
    assert "libcublas.so.13 is CUDA 13" in result.stderr


def test_a_provider_of_the_images_cuda_major_passes(tmp_path):
    library = provider(tmp_path, ["libcudart.so.12", "libcublasLt.so.12", "libcufft.so.11"])
    result = check(library, 12)
    assert result.returncode == 0, result.stderr
    assert "resolves against CUDA 12" in result.stdout


def test_an_unresolved_library_is_refused(tmp_path):
    library = provider(tmp_path, ["libcudart.so.12", "libcudnn.so.9"])
    (tmp_path / "libcudnn.so.9").unlink()  # what a base image without cuDNN looks like
    result = check(library, 12)
    assert result.returncode == 1
    assert "libcudnn.so.9 not found" in result.stderr


def test_only_the_drivers_libcuda_may_be_missing_at_build_time(tmp_path):
    library = provider(tmp_path, ["libcudart.so.12", "libcuda.so.1"])
    (tmp_path / "libcuda.so.1").unlink()  # the NVIDIA container runtime mounts it at run time
    result = check(library, 12)
    assert result.returncode == 0, result.stderr


def test_the_image_pins_an_onnxruntime_gpu_built_for_its_cuda_major():
    # PyPI's onnxruntime-gpu: CUDA 12 builds for 1.19-1.26, CUDA 13 from 1.27 (the wheels' own
    # nvidia-cuda-runtime-cu12 / nvidia-cuda-runtime~=13 requirements say so).
    extras = tomllib.loads((dc.REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (pin,) = [r for r in extras["inference-gpu"] if r.startswith("onnxruntime-gpu")]
    match = re.fullmatch(r"onnxruntime-gpu==1\.(\d+)\.\d+", pin.replace(" ", ""))
    assert match, f"onnxruntime-gpu must be pinned exactly, got {pin!r}"
    dockerfile = (dc.DEPLOY_DIR / "docker" / "inference.Dockerfile").read_text()
    base_major = int(re.search(r"ARG CUDA_IMAGE=nvidia/cuda:(\d+)\.", dockerfile)[1])
    assert (12 if 19 <= int(match[1]) <= 26 else 13) == base_major
    # and the build runs the check against the installed wheel
    assert "check_cuda_libs.py" in dockerfile
