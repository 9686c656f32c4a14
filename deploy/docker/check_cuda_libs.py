"""Image build step: ONNX Runtime's CUDA execution provider resolves against this image's CUDA.

``onnxruntime-gpu`` on PyPI is built for CUDA 12 up to 1.26 and for CUDA 13 from 1.27 on; a
wheel whose CUDA major differs from the base image's installs cleanly, then at run time the
CUDA provider fails to load and ONNX Runtime silently runs on CPU. This script runs ``ldd`` on
the provider's library (``libonnxruntime_providers_cuda.so``) and fails the build when

* any library it needs is not found, except the driver's ``libcuda.so.1`` (the NVIDIA
  container runtime mounts it into the container at run time; a build has no driver), or
* a CUDA toolkit library it needs (``libcudart``, ``libcublas``, ``libcublasLt``, ``libnvrtc``,
  whose soname major is the CUDA major) has another major than the image's CUDA.

The image's CUDA major comes from ``--cuda-major`` or else ``CUDA_VERSION`` (``12.6.3``), which
every ``nvidia/cuda`` base image sets. Only the standard library: it runs in the image's build
stage with the image's own interpreter.

Exit status: 0 the provider resolves; 1 it does not (one line per problem on stderr); 2 usage
(no library found, no CUDA major known, ldd missing).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

PROVIDER_LIBRARY = "libonnxruntime_providers_cuda.so"
DRIVER_LIBRARIES = {"libcuda.so.1"}
"""Provided by the node's driver at run time, never by the image."""
CUDA_VERSIONED = re.compile(r"^lib(cudart|cublas|cublasLt|nvrtc)\.so\.(\d+)$")
"""Toolkit libraries whose soname major is the CUDA major (cuFFT, cuRAND, cuDNN have their own)."""
_LDD_LINE = re.compile(r"^\s*(\S+)\s+=>\s+(not found|\S+)")


def find_provider_library() -> Path | None:
    """The CUDA provider library of the installed ``onnxruntime`` package, if it has one."""
    import importlib.util

    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or spec.origin is None:
        return None
    found = sorted(Path(spec.origin).parent.rglob(PROVIDER_LIBRARY))
    return found[0] if found else None


def needed_libraries(library: Path) -> dict[str, str | None]:
    """``{soname: resolved path or None}`` for every library ``library`` needs, as ``ldd`` sees them.

    Raises:
        FileNotFoundError: ``ldd`` is not installed.
        subprocess.CalledProcessError: ``ldd`` cannot read ``library``.
    """
    out = subprocess.run(["ldd", str(library)], capture_output=True, text=True, check=True, timeout=60).stdout
    needed: dict[str, str | None] = {}
    for line in out.splitlines():
        match = _LDD_LINE.match(line)
        if match:
            needed[match[1]] = None if match[2] == "not found" else match[2]
    return needed


def problems(needed: dict[str, str | None], cuda_major: int) -> list[str]:
    """What keeps the provider from loading on an image with CUDA ``cuda_major``; empty = none."""
    found = []
    for name, path in sorted(needed.items()):
        versioned = CUDA_VERSIONED.match(name)
        if versioned and int(versioned[2]) != cuda_major:
            found.append(f"{name} is CUDA {versioned[2]}, the image has CUDA {cuda_major}: "
                         "install an onnxruntime-gpu built for the image's CUDA major")
        elif path is None and name not in DRIVER_LIBRARIES:
            found.append(f"{name} not found")
    return found


def image_cuda_major(given: int | None) -> int | None:
    if given is not None:
        return given
    version = os.environ.get("CUDA_VERSION", "")
    return int(version.split(".")[0]) if version.split(".")[0].isdigit() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", type=Path, default=None,
                        help=f"library to check [default: the installed onnxruntime's {PROVIDER_LIBRARY}]")
    parser.add_argument("--cuda-major", type=int, default=None,
                        help="the image's CUDA major [default: from CUDA_VERSION]")
    args = parser.parse_args(argv)
    library = args.library or find_provider_library()
    if library is None or not library.is_file():
        print(f"check_cuda_libs: no {PROVIDER_LIBRARY} (is onnxruntime-gpu installed?)", file=sys.stderr)
        return 2
    cuda_major = image_cuda_major(args.cuda_major)
    if cuda_major is None:
        print("check_cuda_libs: the image's CUDA major is unknown: set CUDA_VERSION or pass --cuda-major",
              file=sys.stderr)
        return 2
    try:
        needed = needed_libraries(library)
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"check_cuda_libs: ldd could not read {library}: {exc}", file=sys.stderr)
        return 2
    found = problems(needed, cuda_major)
    for problem in found:
        print(f"check_cuda_libs: {library.name}: {problem}", file=sys.stderr)
    if not found:
        print(f"check_cuda_libs: {library.name} resolves against CUDA {cuda_major} "
              f"({len(needed)} libraries; the driver's libcuda.so.1 comes at run time)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
