"""A real InferenceService process whose model runtimes fail on demand (tests only).

Runs what ``mlpair serve inference`` runs for one process (:func:`mlpair.commands.serve.serve_process`
with the settings from flags and ``INFERENCE_*`` variables), except that every model version's
runtime is the real one (:func:`mlpair.inference.runtimes.create_runtime`) wrapped in
:class:`FaultyRuntime`: before each batch it reads the fault file named by ``MLPAIR_FAULT_FILE``.

Fault file absent or empty: healthy. Otherwise its one word selects the fault, applied to every
served version, or only to the models named in ``MLPAIR_FAULT_MODELS`` (a JSON list) when set:

* ``error``: ``RuntimeError("CUDA error: too many resources requested for launch ...")``, a CUDA
  error the process recovers from (``cudaErrorLaunchOutOfResources`` is not sticky);
* ``oom``: :class:`OutOfMemoryError` (named and worded as torch's ``torch.OutOfMemoryError``);
* ``device_lost``: ``RuntimeError("CUDA error: an illegal memory access was encountered ...")``,
  a sticky error: the CUDA context is lost;
* ``wrong``: the real logits plus 1.0 (a silently corrupted model);
* ``slow:<ms>``: sleeps that many milliseconds, then runs.

An unknown word raises ``ValueError`` per batch (a test's mistake, seen as a runtime error).

Run it as ``python -P tests/fault_inference.py [serve inference flags]`` (what
:func:`tests.fault_support.faulty_inference` does), or ``python -m tests.fault_inference`` from the
repository root where no installed distribution ships a top-level ``tests`` package.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mlpair.contracts.manifest import ModelEntry
    from mlpair.inference.settings import InferenceSettings

FAULT_FILE_ENV = "MLPAIR_FAULT_FILE"
FAULT_MODELS_ENV = "MLPAIR_FAULT_MODELS"
FAULTS = ("error", "oom", "device_lost", "wrong", "slow:<ms>")


class OutOfMemoryError(RuntimeError):
    """Raised as torch raises ``torch.OutOfMemoryError`` (a RuntimeError subclass) when the CUDA
    caching allocator cannot satisfy an allocation."""


class FaultFile:
    """The fault file's current word; re-read only when its inode, mtime or size changes (one ``os.stat``
    per batch otherwise). Thread-safe: executor threads of several versions share it."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._word = ""
        self._lock = threading.Lock()

    def word(self) -> str:
        if not self.path:
            return ""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return ""
        key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)  # a rename is a new inode
        with self._lock:
            if key != self._seen:
                try:
                    with open(self.path) as f:
                        self._word = f.read().strip()
                except FileNotFoundError:
                    self._word = ""
                self._seen = key
            return self._word


class FaultyRuntime:
    """The real runtime of one model version, failing as the fault file says (see the module docstring).

    Args:
        runtime: the real runtime.
        fault_file: shared reader of the fault file.
        applies: whether faults apply to this model.
    """

    def __init__(self, runtime, fault_file: FaultFile, applies: bool) -> None:
        self._runtime = runtime
        self._fault_file = fault_file
        self._applies = applies
        self.description = runtime.description
        self.platform = runtime.platform

    def run(self, features: np.ndarray) -> np.ndarray:
        """Logits ``[batch, n_classes] float32`` for ``features`` ``[batch, n_features] float32``,
        or the fault the file names.

        Raises:
            RuntimeError, OutOfMemoryError: the fault selected; ValueError: an unknown fault word.
        """
        fault = self._fault_file.word() if self._applies else ""
        if not fault:
            return self._runtime.run(features)
        if fault == "error":
            raise RuntimeError(
                "CUDA error: too many resources requested for launch\nCUDA kernel errors might be asynchronously reported "
                "at some other API call, so the stacktrace below might be incorrect."
            )
        if fault == "oom":
            raise OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB "
                "of which 1.06 GiB is free. Of the allocated memory 75.12 GiB is allocated by PyTorch."
            )
        if fault == "device_lost":
            raise RuntimeError(
                "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
                "asynchronously reported at some other API call, so the stacktrace below might be incorrect."
            )
        if fault == "wrong":
            return self._runtime.run(features) + np.float32(1.0)
        if fault.startswith("slow:"):
            time.sleep(float(fault.removeprefix("slow:")) / 1000)
            return self._runtime.run(features)
        raise ValueError(f"unknown fault {fault!r} in {self._fault_file.path}; one of {', '.join(FAULTS)}")

    def device_memory_bytes(self) -> int | None:
        return self._runtime.device_memory_bytes()


def faulty_runtime_factory(environ=os.environ):
    """A runtime factory (``(entry, settings) -> runtime``) wrapping the real one with
    :class:`FaultyRuntime`, configured from ``MLPAIR_FAULT_FILE`` and ``MLPAIR_FAULT_MODELS``."""
    from mlpair.inference.runtimes import create_runtime

    fault_file = FaultFile(environ.get(FAULT_FILE_ENV))
    names = environ.get(FAULT_MODELS_ENV)
    only = set(json.loads(names)) if names else None

    def create(entry: ModelEntry, settings: InferenceSettings):
        runtime = create_runtime(entry, settings)
        return FaultyRuntime(runtime, fault_file, only is None or entry.manifest.model_name in only)

    return create


async def _serve(settings: InferenceSettings, *, shared_port: bool = False) -> None:
    from mlpair.inference.server import serve

    await serve(settings, shared_port=shared_port, runtime_factory=faulty_runtime_factory())


def main(argv: list[str] | None = None) -> int:
    """``mlpair serve inference [flags]`` as one process with failing-on-demand runtimes; the exit code."""
    from mlpair.cli import _fail, build_parser
    from mlpair.commands.serve import serve_process, settings_from_args
    from mlpair.inference.settings import InferenceSettings
    from mlpair.logs import configure_logging
    from mlpair.startup import StartupError

    args = build_parser().parse_args(["serve", "inference", *(sys.argv[1:] if argv is None else argv)])
    try:
        settings = settings_from_args(InferenceSettings, args)
    except StartupError as exc:
        return _fail("inference service", exc, 2)
    configure_logging("inference", settings.log_level, settings.log_format, sample_ratio=settings.log_sample_ratio)
    return serve_process("inference", settings, _serve)


if __name__ == "__main__":
    sys.exit(main())
