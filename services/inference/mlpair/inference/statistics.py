"""Per-model-version statistics, the domain side of the OIP statistics extension.

Field meanings follow Triton's ``ModelStatistics`` (``grpc_service.proto`` and the statistics
extension document): durations are cumulative nanoseconds with a count, kept since the version
was loaded and dropped when it is unloaded.

They are recorded at the same points, from the same measured values, as the ``inference_*``
Prometheus metrics, so the two agree exactly (``tests/inference/test_oip_extensions.py``
compares them):

=========================================  ==============================================================
statistic                                  Prometheus (same model and version labels)
=========================================  ==============================================================
``success.count + fail.count``             ``inference_requests_total`` (every code)
``success.count``                          ``inference_requests_total{code="OK"}``
``success.ns + fail.ns``                   ``inference_request_duration_seconds_sum`` × 1e9
``queue.count``, ``queue.ns``              ``inference_queue_duration_seconds`` count, sum × 1e9
``execution_count``                        ``inference_compute_duration_seconds_count``
Σ ``batch_stats[].compute_infer.ns``       ``inference_compute_duration_seconds_sum`` × 1e9
Σ ``batch_size × compute_infer.count``     ``inference_batch_size_rows_sum`` (rows executed)
=========================================  ==============================================================

Where they differ from Triton, they follow the metrics: ``fail`` counts every code but OK
(cancelled callers too); ``queue`` and ``compute_*`` count every queued item that reached an
execution (a request, or each ``max_batch_size`` chunk of a larger request), and
``execution_count`` every execution, also one whose runtime failed. ``compute_output`` counts
only executions whose logits were handed back.
"""

from __future__ import annotations

import time

NS_PER_S = 1_000_000_000


class Duration:
    """A count and the cumulative duration of what it counts, in nanoseconds."""

    __slots__ = ("count", "ns")

    def __init__(self) -> None:
        self.count = 0
        self.ns = 0

    def add(self, seconds: float, count: int = 1) -> None:
        """Adds ``count`` occurrences that took ``seconds`` in all."""
        self.count += count
        self.ns += int(seconds * NS_PER_S)


class BatchSizeStatistics:
    """Executions at one batch size (rows): input assembly, model execution, output hand-back."""

    __slots__ = ("compute_input", "compute_infer", "compute_output")

    def __init__(self) -> None:
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()


class VersionStatistics:
    """Cumulative statistics of one serving model version (see the module docstring).

    The engine records each request's outcome (:meth:`request_done`); the version's batcher
    records queue waits and executions. Single-threaded: every call happens on the event loop.
    """

    __slots__ = (
        "success",
        "fail",
        "queue",
        "compute_input",
        "compute_infer",
        "compute_output",
        "batches",
        "inference_count",
        "execution_count",
        "last_inference_ms",
    )

    def __init__(self) -> None:
        self.success = Duration()
        self.fail = Duration()
        self.queue = Duration()
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()
        self.batches: dict[int, BatchSizeStatistics] = {}
        self.inference_count = 0
        """Rows of successful requests."""
        self.execution_count = 0
        self.last_inference_ms = 0
        """End of the last request, in milliseconds since the epoch; 0 before the first."""

    @property
    def executed_rows(self) -> int:
        """Rows the model has executed (every execution, failed ones too)."""
        return sum(size * stats.compute_infer.count for size, stats in self.batches.items())

    def request_done(self, ok: bool, seconds: float, rows: int) -> None:
        """One request ended: ``ok`` or not, after ``seconds`` in the server, with ``rows`` rows."""
        if ok:
            self.success.add(seconds)
            self.inference_count += rows
        else:
            self.fail.add(seconds)
        self.last_inference_ms = time.time_ns() // 1_000_000

    def executed(self, requests: int, rows: int, input_s: float, infer_s: float) -> None:
        """One execution of ``rows`` rows for ``requests`` queued items: assembly and model time."""
        self.execution_count += 1
        batch = self.batches.get(rows)
        if batch is None:
            batch = self.batches[rows] = BatchSizeStatistics()
        batch.compute_input.add(input_s)
        batch.compute_infer.add(infer_s)
        # Per request, as Triton counts: a batch's time counts for each request in it.
        self.compute_input.add(input_s * requests, requests)
        self.compute_infer.add(infer_s * requests, requests)

    def handed_back(self, requests: int, rows: int, output_s: float) -> None:
        """The logits of one execution went back to its ``requests`` callers in ``output_s``."""
        self.batches[rows].compute_output.add(output_s)
        self.compute_output.add(output_s * requests, requests)
