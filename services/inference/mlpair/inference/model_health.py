"""Health after start: whether each serving model version can answer now, not only whether it loaded.

Two signals per served version (:class:`VersionHealth`), both judged on the version's own batcher:

* **consecutive batch failures**: a batch whose runtime raised (any exception: CUDA errors and
  out-of-memory included) or returned the wrong number of rows counts one; a batch that succeeded
  resets the count (one integer store per batch: the hot path pays nothing more).
  ``unhealthy_after_failures`` in a row turn the version unhealthy; a sticky CUDA error
  (``device_lost``) does so at once;
* **a known-answer self-test**: at warm-up the version records :data:`SELF_TEST_ROWS` seeded rows
  and their logits (:class:`KnownAnswer`); every ``self_test_interval_s`` while healthy, every
  ``self_test_retry_s`` while unhealthy (and at once on turning unhealthy), the rows go through the
  version's batcher like any request (so they never run beside a batch the batcher would not run
  at once anyway) and the logits are compared with the recorded ones. A failing self-test (the
  batch failed, no answer within :data:`SELF_TEST_TIMEOUT_S`, or logits outside the tolerance)
  turns the version unhealthy; a passing one turns an unhealthy version healthy again. Only the
  self-test sees a model that returns wrong numbers without an error.

An unhealthy version is not ready: OIP ``ModelReady`` false, its model's health name NOT_SERVING
when no other version of it is healthy, ``inference_model_ready`` and ``inference_model_healthy``
0, and the server NOT_SERVING while an expected model has no healthy version. Requests for it are
refused UNAVAILABLE ``MODEL_UNHEALTHY`` (retryable on another replica) and never run on its runtime;
with several versions serving, a request that names no version goes to the highest healthy one.

Failure causes (:func:`classify_runtime_failure`): ``out_of_memory``, ``device_lost``,
``wrong_output``, ``runtime_error``. ``device_lost`` also fails liveness for good
(:meth:`mlpair.inference.engine.InferenceEngine.mark_device_lost`): the CUDA context cannot run
anything again in this process, so the kubelet restarts the pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mlpair.background import stop_task
from mlpair.inference import metrics
from mlpair.inference.errors import DeadlineExpired, ModelFailure, ModelNotReady, QueueFull

if TYPE_CHECKING:
    from mlpair.inference.batcher import DynamicBatcher
    from mlpair.inference.settings import InferenceSettings

logger = logging.getLogger(__name__)

OUT_OF_MEMORY = "out_of_memory"
DEVICE_LOST = "device_lost"
WRONG_OUTPUT = "wrong_output"
RUNTIME_ERROR = "runtime_error"
CAUSES = (OUT_OF_MEMORY, DEVICE_LOST, WRONG_OUTPUT, RUNTIME_ERROR)
"""Values of the ``cause`` label of ``inference_runtime_failures_total``."""

# CUDA errors after which "the process is in an inconsistent state and any further CUDA work will
# return the same error. To continue using CUDA, the process must be terminated and relaunched"
# (CUDA Runtime API reference, enum cudaError; the driver API's CUresult says the same). Matched in
# the message, lower case, as torch ("CUDA error: <description>") and ONNX Runtime ("CUDA failure
# <code>: <description>", or the enum name) word them.
STICKY_CUDA_ERRORS = (
    "an illegal memory access was encountered",  # cudaErrorIllegalAddress (700)
    "the launch timed out and was terminated",  # cudaErrorLaunchTimeout (702)
    "device-side assert triggered",  # cudaErrorAssert (710)
    "hardware stack error",  # cudaErrorHardwareStackError (714)
    "an illegal instruction was encountered",  # cudaErrorIllegalInstruction (715)
    "misaligned address",  # cudaErrorMisalignedAddress (716)
    "operation not supported on global/shared address space",  # cudaErrorInvalidAddressSpace (717)
    "invalid program counter",  # cudaErrorInvalidPc (718)
    "unspecified launch failure",  # cudaErrorLaunchFailure (719)
    "uncorrectable ecc error encountered",  # cudaErrorECCUncorrectable (214)
    "cudaerrorillegaladdress",
    "cuda_error_illegal_address",
    "cudaerrorlaunchtimeout",
    "cuda_error_launch_timeout",
    "cudaerrorassert",
    "cuda_error_assert",
    "cudaerrorhardwarestackerror",
    "cuda_error_hardware_stack_error",
    "cudaerrorillegalinstruction",
    "cuda_error_illegal_instruction",
    "cudaerrormisalignedaddress",
    "cuda_error_misaligned_address",
    "cudaerrorinvalidaddressspace",
    "cuda_error_invalid_address_space",
    "cudaerrorinvalidpc",
    "cuda_error_invalid_pc",
    "cudaerrorlaunchfailure",
    "cuda_error_launch_failed",
    "cudaerroreccuncorrectable",
    "cuda_error_ecc_uncorrectable",
)
# torch raises torch.OutOfMemoryError (= torch.cuda.OutOfMemoryError, "CUDA out of memory. Tried to
# allocate ..."); ONNX Runtime's arena says "Failed to allocate memory for requested buffer" and CUDA
# itself "out of memory" (cudaErrorMemoryAllocation).
OUT_OF_MEMORY_MESSAGES = ("out of memory", "failed to allocate memory", "cudaerrormemoryallocation")

SELF_TEST_ROWS = 8
"""Rows of the known-answer batch."""
SELF_TEST_SEED = 20261204
"""Seed of the known-answer rows (standard normal, float32: the scale of standardised features)."""
SELF_TEST_TIMEOUT_S = 5.0
"""A self-test not answered within this many seconds fails (a runtime that hangs)."""
SPREAD_FACTOR = 4.0
"""Multiple of the spread measured at warm-up added to ``self_test_atol`` (see :class:`KnownAnswer`)."""


def classify_runtime_failure(exc: BaseException) -> str:
    """The cause of a runtime's exception: ``out_of_memory``, ``device_lost`` or ``runtime_error``.

    ``out_of_memory``: an exception class named ``OutOfMemoryError`` anywhere in its MRO (torch's
    ``torch.OutOfMemoryError``, alias ``torch.cuda.OutOfMemoryError``), a ``MemoryError``, or a message
    saying out of memory / failed to allocate memory (ONNX Runtime, CUDA). ``device_lost``: a message
    naming one of CUDA's sticky errors (:data:`STICKY_CUDA_ERRORS`). Anything else: ``runtime_error``.
    (``wrong_output`` is decided by the caller: a wrong row count, a self-test mismatch.)
    """
    if isinstance(exc, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(exc).__mro__):
        return OUT_OF_MEMORY
    message = str(exc).lower()
    if any(text in message for text in STICKY_CUDA_ERRORS):
        return DEVICE_LOST
    if any(text in message for text in OUT_OF_MEMORY_MESSAGES):
        return OUT_OF_MEMORY
    return RUNTIME_ERROR


@dataclass(frozen=True)
class KnownAnswer:
    """A version's self-test: ``features`` ``[SELF_TEST_ROWS, n_features] float32`` and the
    ``logits`` ``[SELF_TEST_ROWS, n_classes] float32`` the runtime gave for them at warm-up.

    Logits ``y`` match when, element-wise, ``|y - logits| <= atol + rtol * |logits|`` (numpy's
    ``isclose``; NaN matches NaN, an infinity only itself). ``atol`` is ``self_test_atol`` plus
    :data:`SPREAD_FACTOR` times the spread measured at warm-up: the largest difference between the
    rows run alone, alone again, and as the last rows of a ``max_batch_size`` batch, which is what
    batch size, padding and kernel choice change on this runtime and device (0 for ONNX Runtime on
    CPU here; half precision on CUDA widens it by itself).
    """

    features: np.ndarray
    logits: np.ndarray
    atol: float
    rtol: float

    @classmethod
    def record(
        cls, run: Callable[[np.ndarray], np.ndarray], n_features: int, max_batch_size: int, atol: float, rtol: float
    ) -> KnownAnswer:
        """Runs the seeded rows on ``run`` (blocking; at warm-up, before the version serves)."""
        x = np.random.default_rng(SELF_TEST_SEED).standard_normal((SELF_TEST_ROWS, n_features), dtype=np.float32)
        reference = np.asarray(run(x), dtype=np.float32)
        again = run(x)
        padded = np.zeros((max(max_batch_size, SELF_TEST_ROWS), n_features), dtype=np.float32)
        padded[-SELF_TEST_ROWS:] = x
        inside = run(padded)[-SELF_TEST_ROWS:]
        spread = max(_max_difference(reference, again), _max_difference(reference, inside))
        return cls(x, reference, atol + SPREAD_FACTOR * spread, rtol)

    def mismatch(self, logits: np.ndarray) -> str | None:
        """None when ``logits`` match (see the class docstring); else why, one line."""
        if logits.shape != self.logits.shape:
            return f"shape {logits.shape} instead of {self.logits.shape}"
        if np.isclose(logits, self.logits, rtol=self.rtol, atol=self.atol, equal_nan=True).all():
            return None
        return (
            f"logits differ from the warm-up's by up to {_max_difference(self.logits, logits):.3g} "
            f"(tolerance {self.atol:.3g} + {self.rtol:.3g} * |logit|)"
        )


def _max_difference(a: np.ndarray, b: np.ndarray) -> float:
    finite = np.isfinite(a) & np.isfinite(b)
    return float(np.abs(a[finite] - b[finite]).max(initial=0.0))


class VersionHealth:
    """Health of one serving model version after start (see the module docstring).

    Args:
        name, version: the model version (metric labels, log lines).
        settings: ``unhealthy_after_failures``, ``self_test_interval_s``, ``self_test_retry_s``.
        known: the self-test recorded at warm-up.
        on_change: called (on the event loop) after every transition, healthy or not.
        on_device_lost: called once with a one-line reason when a sticky CUDA error is seen.
    """

    def __init__(
        self,
        name: str,
        version: str,
        settings: InferenceSettings,
        known: KnownAnswer,
        on_change: Callable[[VersionHealth], None],
        on_device_lost: Callable[[str], None],
    ) -> None:
        self.name, self.version = name, version
        self.known = known
        self.healthy = True
        self.failures = 0
        """Consecutive failed batches (0 after any batch that succeeded)."""
        self.cause: str | None = None
        """Cause of the latest failure."""
        self.problem: str | None = None
        """Why the version is unhealthy (one line), None while healthy."""
        self._unhealthy_after = settings.unhealthy_after_failures
        self._interval_s = settings.self_test_interval_s
        self._retry_s = settings.self_test_retry_s
        self._on_change = on_change
        self._on_device_lost = on_device_lost
        self._since = 0.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # Every child created now: each series exists from the start (rates and alerts see 0, not nothing).
        self._m_failures = {cause: metrics.RUNTIME_FAILURES.labels(name, version, cause) for cause in CAUSES}
        self._m_self_test = {result: metrics.SELF_TEST.labels(name, version, result) for result in ("pass", "fail")}
        self._m_self_test_duration = metrics.SELF_TEST_DURATION.labels(name, version)
        self._m_healthy = metrics.MODEL_HEALTHY.labels(name, version)
        self._m_healthy.set(1)

    # -- batch outcomes (the batcher, on the event loop) --------------------------------------------

    def batch_succeeded(self) -> None:
        """A batch ran and returned one row of logits per row: the failure streak ends."""
        self.failures = 0

    def batch_failed(self, exc: BaseException | None, cause: str | None = None) -> bool:
        """Counts a failed batch: ``exc`` (what the runtime raised, classified) or ``cause`` (e.g.
        ``wrong_output``). Returns whether it is the first of a streak (the batcher logs only that one)."""
        cause = cause or (classify_runtime_failure(exc) if exc is not None else RUNTIME_ERROR)
        self._m_failures[cause].inc()
        first = self.failures == 0
        self.failures += 1
        self.cause = cause
        if cause == DEVICE_LOST:
            line = str(exc).strip().splitlines()[0][:200] if exc is not None and str(exc).strip() else cause
            self._on_device_lost(f"model {self.name} version {self.version}: {line}")
        if self.healthy and (self.failures >= self._unhealthy_after or cause == DEVICE_LOST):
            self._turn_unhealthy(f"{self.failures} consecutive batch failure(s) ({cause})")
        return first

    # -- the self-test ----------------------------------------------------------------------------

    def start(self, batcher: DynamicBatcher) -> None:
        """Starts the periodic self-test on ``batcher`` (the running event loop's task)."""
        name = f"self-test-{self.name}-{self.version}"
        self._task = asyncio.get_running_loop().create_task(self._self_tests(batcher), name=name)

    async def close(self) -> None:
        """Stops the self-test (before the batcher closes)."""
        await stop_task(self._task)
        self._task = None
        if metrics.shared_across_processes():
            self._m_healthy.set(1)  # multiprocess mode cannot remove a series: a retired version is not unhealthy
        else:
            metrics.MODEL_HEALTHY.remove(self.name, self.version)

    async def _self_tests(self, batcher: DynamicBatcher) -> None:
        while True:
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval_s if self.healthy else self._retry_s)
            try:
                await self.self_test(batcher)
            except ModelNotReady:  # the batcher is closing: the version is being retired
                return
            except Exception:  # the loop must outlive any single self-test
                logger.exception("self-test of model %s version %s could not run", self.name, self.version)

    async def self_test(self, batcher: DynamicBatcher) -> bool | None:
        """Runs the known-answer batch through ``batcher`` once and acts on the result.

        Returns:
            True passed, False failed, None not judged (the queue was full or the deadline passed
            in the queue: a busy server, not a broken model).

        Raises:
            ModelNotReady: the batcher is closing.
        """
        started = time.perf_counter()
        cause = WRONG_OUTPUT
        try:
            logits = await asyncio.wait_for(batcher.submit_self_test(self.known.features), SELF_TEST_TIMEOUT_S)
        except (QueueFull, DeadlineExpired):
            logger.debug("self-test of model %s version %s skipped: the queue is busy", self.name, self.version)
            return None
        except ModelFailure:
            cause = self.cause or RUNTIME_ERROR
            problem: str | None = f"the batch failed ({cause})"
        except TimeoutError:
            cause = RUNTIME_ERROR
            problem = f"no answer within {SELF_TEST_TIMEOUT_S:.0f} s"
        else:
            problem = self.known.mismatch(logits)
            if problem is not None:
                self._m_failures[WRONG_OUTPUT].inc()  # the batch ran: only the comparison saw it
                self.cause = WRONG_OUTPUT
        self._m_self_test_duration.observe(time.perf_counter() - started)
        self._m_self_test["pass" if problem is None else "fail"].inc()
        if problem is None:
            if not self.healthy:
                self._turn_healthy()
            return True
        if self.healthy:
            self._turn_unhealthy(f"self-test failed: {problem}")
        return False

    # -- transitions ------------------------------------------------------------------------------

    def _turn_unhealthy(self, problem: str) -> None:
        self.healthy = False
        self.problem = problem
        self._since = time.monotonic()
        self._m_healthy.set(0)
        logger.warning("model %s version %s not ready: %s", self.name, self.version, problem)
        self._wake.set()  # self-test at once, then every self_test_retry_s
        self._on_change(self)

    def _turn_healthy(self) -> None:
        self.healthy = True
        self.problem = None
        self.failures = 0
        self._m_healthy.set(1)
        logger.info(
            "model %s version %s ready again: self-test passed after %.1f s not ready",
            self.name,
            self.version,
            time.monotonic() - self._since,
        )
        self._on_change(self)
