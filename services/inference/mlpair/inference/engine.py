"""The transport-neutral core of InferenceService: one path for every protocol.

For each request, in order and all before it may join a batch: the server is not draining;
the model and version are serving; the caller's ``x-feature-version`` equals the model's
feature schema version; the input's name, dtype, shape, size and values are valid. Only then
do its rows enter the version's :class:`~mlpair.inference.batcher.DynamicBatcher`.

Each request is judged on its own rows' output: a row with a NaN or Inf logit fails that
request (INTERNAL, ``MODEL_FAILURE``, naming the rows), or, when the caller asked for
``per_row_errors``, is reported as that row's error with zero logits while the other rows are
returned. Either way the request's batch-mates never see it, and every such row is counted.

Readiness: the server is ready when it is not draining, no server-level condition is set and
every expected model has a serving (loaded, verified, warmed) version that is healthy now
(:mod:`mlpair.inference.model_health`: no failure streak, its known-answer self-test passing).
Liveness is the process answering at all, until a sticky CUDA error loses the device.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np
from prometheus_client import Counter

from mlpair import logs
from mlpair.errors import ServiceError
from mlpair.inference import metrics
from mlpair.inference.batch_queue import resolve_priority
from mlpair.inference.errors import Draining, InvalidInput, ModelFailure
from mlpair.inference.repository import ModelRepository, RuntimeFactory
from mlpair.inference.runtimes import create_runtime
from mlpair.inference.settings import InferenceSettings
from mlpair.inference.validation import TensorIn, all_finite, check_feature_version, decode_features
from mlpair.inference.versions import ServedVersion

logger = logging.getLogger(__name__)


NON_FINITE_OUTPUT = "NON_FINITE_OUTPUT"
"""Reason of a row error: the model produced a NaN or Inf logit for that row."""
MAX_NAMED_ROWS = 5  # rows named in one error message
# A call cancelled this close to its deadline, or after it, is counted DEADLINE_EXCEEDED: the
# caller's timer started when it sent the call, this server's when the call arrived, so the
# caller's deadline passes (and gRPC cancels the call) as much earlier as the call took to
# arrive — milliseconds on a busy machine, where 1 ms counted some deadlines as CANCELLED.
DEADLINE_SLACK_S = 0.02


@dataclass(frozen=True, slots=True)
class InferResult:
    """Logits ``[batch, n_classes] float32`` and the version that produced them.

    ``invalid_rows`` lists (ascending) the rows whose output was unusable (non-finite); their
    logits here are zeros. Never set unless the request asked for ``per_row_errors``.
    """

    model_name: str
    model_version: str
    output_name: str
    logits: np.ndarray
    invalid_rows: tuple[int, ...] = ()


class InferenceEngine:
    """Validates requests and runs them through the serving model versions.

    Args:
        settings: the service settings.
        runtime_factory: builds a runtime per model version (default: from the settings).
        on_change: awaited whenever readiness may have changed (the server refreshes health).
    """

    def __init__(
        self,
        settings: InferenceSettings,
        runtime_factory: RuntimeFactory = create_runtime,
        on_change: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self.repository = ModelRepository(
            settings, runtime_factory, on_change=self._changed, on_device_lost=self._runtime_lost_device
        )
        self._on_change = on_change
        self._max_rows = settings.max_request_rows
        self.draining = False
        self.stopping = False
        """Set when the drain starts (readiness withdrawn); ``draining`` follows after the accept window."""
        self._in_flight = 0
        self._idle = asyncio.Event()
        self.drain_started = asyncio.Event()
        """Set by :meth:`begin_drain`: open ModelStreamInfer streams answer what they hold and end."""
        self._poller: asyncio.Task | None = None
        self._counters: dict[tuple[str, str, str], Counter] = {}
        self._conditions: dict[str, str] = {}
        """Server-level readiness problems by name (e.g. device memory): any one makes the server not ready."""
        self.device_lost: str | None = None
        """Why the device can no longer run anything (a sticky CUDA error); liveness fails while set."""

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Loads every model (verify, warm up) and starts repository polling if configured.

        An unreadable model source is retried with backoff meanwhile (not ready, condition
        ``model_source`` with the reason: :mod:`mlpair.inference.sourcing`).

        Raises:
            ManifestError, InferenceError, VersionRefused: a model cannot be served; nothing is ready.
        """
        from mlpair.inference.sourcing import with_backoff

        await with_backoff(self.repository.load_all, self.set_condition, self.settings.source_retry_max_s)
        if self.settings.model_control == "poll":
            self._poller = asyncio.get_running_loop().create_task(
                self.repository.poll_forever(self.settings.repository_poll_s), name="repository-poll"
            )

    def ready(self) -> bool:
        """Server readiness: not stopping, no server-level problem (:meth:`set_condition`) and every
        expected model serving."""
        return not self.stopping and not self._conditions and self.repository.all_expected_ready()

    def live(self) -> bool:
        """Liveness: False only once the device is lost for good (:meth:`mark_device_lost`)."""
        return self.device_lost is None

    async def set_condition(self, name: str, problem: str | None) -> None:
        """Records (``problem``: why, one line) or clears (None) a server-level readiness problem
        named ``name``; readiness is republished when it changes."""
        if self._conditions.get(name) == problem:
            return
        if problem is None:
            self._conditions.pop(name, None)
        else:
            self._conditions[name] = problem
        await self._changed()

    def conditions(self) -> dict[str, str]:
        """The server-level readiness problems now, by name."""
        return dict(self._conditions)

    async def mark_device_lost(self, reason: str) -> None:
        """The device cannot run anything again in this process (a sticky CUDA error: the context
        is lost): liveness fails from now on, so the kubelet restarts the pod."""
        if self.device_lost is None:
            self.device_lost = reason
            await self._changed()

    async def _runtime_lost_device(self, reason: str) -> None:
        """A runtime raised a sticky CUDA error: liveness fails, and readiness with it (condition
        ``device_lost``) whatever later self-tests say."""
        if self.device_lost is None:
            logger.error("device lost, liveness fails so the pod restarts: %s", reason)
        await self.set_condition("device_lost", reason)
        await self.mark_device_lost(reason)

    def model_ready(self, name: str, version: str = "") -> bool:
        """Whether ``name`` (at ``version``, or any) is serving and healthy, and the server is not stopping."""
        return not self.stopping and self.repository.is_ready(name, version)

    async def withdraw_readiness(self) -> None:
        """The drain started: every readiness signal (OIP ServerReady/ModelReady, health) says not
        ready from now on, while requests are still served until :meth:`begin_drain`."""
        self.stopping = True
        await self._changed()

    async def begin_drain(self) -> None:
        """Refuses new requests from now on (UNAVAILABLE); in-flight ones continue."""
        self.stopping = self.draining = True
        self.drain_started.set()
        if self._in_flight == 0:
            self._idle.set()
        await self._changed()

    async def wait_idle(self, timeout_s: float) -> bool:
        """After :meth:`begin_drain`: waits until no request is in flight; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        """Stops polling and retires every model version (queued work finishes first)."""
        if self._poller is not None:
            self._poller.cancel()
        await self.repository.close()

    async def _changed(self) -> None:
        if self._on_change is not None:
            await self._on_change()

    # -- serving ---------------------------------------------------------------------------

    def model(self, name: str, version: str = "") -> ServedVersion:
        """The serving version (empty = highest) of ``name``.

        Raises:
            ModelNotFound, ModelNotReady.
        """
        return self.repository.get(name, version)

    def versions(self, name: str = "", version: str = "") -> list[ServedVersion]:
        """Serving versions a statistics request names: every model's (empty name), every version
        of ``name`` (empty version), or just ``version``; sorted by name and version.

        Raises:
            ModelNotFound, ModelNotReady: the model, or that version of it, is not serving.
        """
        if name and version:
            return [self.repository.get(name, version)]
        serving = self.repository.serving()
        if name and name not in serving:
            self.repository.get(name)  # raises the error that names what is serving
        names = [name] if name else sorted(serving)
        return [self.repository.get(n, v) for n in names for v in serving[n]]

    async def infer(
        self,
        name: str,
        version: str,
        feature_version: str | None,
        tensor: TensorIn,
        deadline: float | None = None,
        outputs: Sequence[str] = (),
        *,
        per_row_errors: bool = False,
        priority: int = 0,
    ) -> InferResult:
        """Validates one request and returns its logits, counting its outcome and latency.

        Args:
            name, version: model and version (empty = the highest serving).
            feature_version: the caller's ``x-feature-version``; None when absent.
            tensor: ``[batch, n_features]`` FP32 as it arrived.
            deadline: ``time.monotonic()`` instant the caller stops waiting, or None.
            outputs: requested output names (empty = all).
            per_row_errors: report a row with non-finite output as that row's error
                (``InferResult.invalid_rows``) instead of failing the request.
            priority: batch-queue level, 1 (highest) … ``priority_levels``; 0 = the default level.

        Raises:
            Draining, ModelNotReady, ModelNotFound, FeatureVersionMismatch, InvalidInput (also for
            an undefined ``priority``), QueueFull (the request's priority level is full), DeadlineExpired, ModelFailure (the whole batch failed, or a row's output
            is non-finite and ``per_row_errors`` is off), ModelUnhealthy (the version is not
            healthy after start: retry on another replica).
        """
        started = time.perf_counter()
        self._in_flight += 1
        served = None
        code = "OK"
        rows = 0
        try:
            if self.draining:
                raise Draining("the server is shutting down; retry on another replica")
            served = self.repository.route(name, version)
            check_feature_version(served.feature_version, feature_version)
            level = resolve_priority(priority, self.settings.priority_levels, self.settings.default_level)
            if tensor.name and tensor.name != served.input_name:
                raise InvalidInput(f"unknown input {tensor.name!r}; model {name!r} takes {served.input_name!r}")
            for output in outputs:
                if output != served.output_name:
                    raise InvalidInput(f"unknown output {output!r}; model {name!r} produces {served.output_name!r}")
            x = decode_features(tensor, served.n_features, self._max_rows)
            rows = x.shape[0]
            validated = time.perf_counter()
            logs.record_stage("validate", validated - started)
            if rows == 0:
                return InferResult(
                    served.name, served.version, served.output_name, np.zeros((0, served.n_classes), dtype=np.float32)
                )
            logits = await served.batcher.submit(x, deadline, level)
            logs.record_stage("queue_and_compute", time.perf_counter() - validated)
            if all_finite(logits):
                return InferResult(served.name, served.version, served.output_name, logits)
            return self._invalid_output(served, logits, per_row_errors)
        except ServiceError as exc:
            code = exc.code
            raise
        except asyncio.CancelledError:
            # gRPC cancels a call whose deadline passed: that is the deadline, not the caller leaving
            expired = deadline is not None and time.monotonic() >= deadline - DEADLINE_SLACK_S
            code = "DEADLINE_EXCEEDED" if expired else "CANCELLED"
            raise
        except Exception:
            code = "INTERNAL"
            raise
        finally:
            self._in_flight -= 1
            if self.draining and self._in_flight == 0:
                self._idle.set()
            if served is not None:
                elapsed = time.perf_counter() - started
                served.m_duration.observe(elapsed)
                served.batcher.statistics.request_done(code == "OK", elapsed, rows)
                self._count(served.name, served.version, code)
            else:
                # Labels only take loaded names: a client must not create time series (a served model
                # refused as unhealthy keeps its name).
                self._count(name if self.repository.is_serving(name) else "unknown", "", code)

    @staticmethod
    def _invalid_output(served: ServedVersion, logits: np.ndarray, per_row_errors: bool) -> InferResult:
        """A request some of whose rows have non-finite logits: counted per row, then refused
        whole (ModelFailure) or answered with those rows zeroed and listed."""
        bad = np.flatnonzero(~np.isfinite(logits).all(axis=1))
        served.m_nonfinite.inc(len(bad))
        if not per_row_errors:
            named = ", ".join(str(r) for r in bad[:MAX_NAMED_ROWS]) + (" …" if len(bad) > MAX_NAMED_ROWS else "")
            raise ModelFailure(
                f"the model produced a non-finite logit for row(s) {named} of this request",
                metadata={"reason": NON_FINITE_OUTPUT, "rows": str(len(bad))},
            )
        logits = logits.copy()
        logits[bad] = 0.0
        return InferResult(served.name, served.version, served.output_name, logits, tuple(int(r) for r in bad))

    def count_refusal(self, name: str, code: str) -> None:
        """Counts an inference call refused before :meth:`infer` saw it (its message, metadata or
        parameters), as :meth:`infer` counts the calls it refuses: under ``name`` when that model is
        served, else ``unknown``; ``code``: the status code name."""
        self._count(name if name and self.repository.is_ready(name) else "unknown", "", code)

    def _count(self, name: str, version: str, code: str) -> None:
        key = (name, version, code)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = metrics.REQUESTS.labels(name, version, code)
        counter.inc()
