"""A batch-scoring job's metrics in the Prometheus text format: written to a file for
node_exporter's textfile collector (atomically) and/or pushed to a Pushgateway.

Series (label ``job``: the job id; scrape them with ``honor_labels: true`` so the job's label
stays ``job``):

- ``inference_job_rows_total{job,outcome}``: rows finished, by outcome (decided, replayed, failed).
- ``inference_job_rows_per_second{job}``: the current run's rate (to its end once it finished or
  stopped).
- ``inference_job_duration_seconds{job}``: seconds since the job first started (to the end of its
  last run once it finished or stopped).
- ``inference_job_deadline_timestamp_seconds{job}``: the completion deadline (only with one).
- ``inference_job_estimated_completion_timestamp_seconds{job}``: when the job will be done at the
  current rate (its end once finished; when it stopped, for a stopped run; absent before a rate is
  known).
- ``inference_job_finished{job}``: 1 once the output is assembled, else 0.

The alert ``ScoreJobWillMissDeadline`` (deploy/observability/prometheus/rules.yaml) reads them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mlpair.jobs.state import OUTCOMES, JobState

JOB_METRICS = (
    "inference_job_rows",
    "inference_job_rows_per_second",
    "inference_job_duration_seconds",
    "inference_job_deadline_timestamp_seconds",
    "inference_job_estimated_completion_timestamp_seconds",
    "inference_job_finished",
)
"""The metric families a job exports (``inference_job_rows`` is a counter: ``_total``)."""


class JobCollector(Collector):
    """The metrics of one job, read from its :class:`~mlpair.jobs.state.JobState` at collection."""

    def __init__(self, state: JobState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        """The job's metrics as its state holds them now: rows finished by outcome, rows per second,
        seconds since it first started, its deadline and estimated completion (UNIX time, when known),
        and whether its output is assembled; each labelled with the job id.
        """
        state, job = self.state, [self.state.job_id]
        rows = CounterMetricFamily(
            "inference_job_rows", "Rows of the job finished, by outcome", labels=["job", "outcome"]
        )
        for outcome in OUTCOMES:
            rows.add_metric([*job, outcome], state.rows(outcome))
        yield rows
        yield _gauge("inference_job_rows_per_second", "Rows finished per second in the current run", job, state.rate())
        yield _gauge("inference_job_duration_seconds", "Seconds since the job first started", job, state.duration())
        if state.deadline is not None:
            yield _gauge(
                "inference_job_deadline_timestamp_seconds", "The job's deadline, UNIX time", job, state.deadline
            )
        # a stopped run has no estimate of its own: it reports when it stopped, so the deadline alert
        # (which counts a past estimate as now) fires once the deadline passes and it is not rerun
        estimate = state.run_ended_at if state.stopped else state.estimated_completion()
        if estimate is not None:
            yield _gauge(
                "inference_job_estimated_completion_timestamp_seconds",
                "When the job will be done at the current rate, UNIX time",
                job,
                estimate,
            )
        finished = 1.0 if state.finished_at is not None else 0.0
        yield _gauge("inference_job_finished", "1 once the job's output is assembled", job, finished)


def _gauge(name: str, documentation: str, job: list[str], value: float) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, documentation, labels=["job"])
    gauge.add_metric(job, value)
    return gauge


def registry_for(state: JobState) -> CollectorRegistry:
    """A registry holding only the job's metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(JobCollector(state))
    return registry


class JobMetrics:
    """Where a job reports its metrics: ``path`` (textfile collector; written atomically) and/or
    ``pushgateway`` (``host:port`` or URL; grouped by ``job`` = the job id). Neither: a no-op."""

    def __init__(self, state: JobState, path: Path | None, pushgateway: str | None) -> None:
        self.registry = registry_for(state)
        self.path = path
        self.pushgateway = pushgateway
        self.state = state

    def report(self) -> None:
        """Writes and pushes the current values.

        Raises:
            OSError: the file cannot be written or the Pushgateway cannot be reached.
        """
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_to_textfile(str(self.path), self.registry)
        if self.pushgateway:
            from prometheus_client import push_to_gateway

            push_to_gateway(self.pushgateway, job=self.state.job_id, registry=self.registry, timeout=5)
