"""The batch-scoring job on this machine: the input read chunk by chunk, a few chunks in flight to
PredictionService at once, each finished chunk kept as a part file and recorded in the job's state,
the output assembled from the parts when every chunk is done.

Resuming: a rerun of the same job skips the chunks its state records as done and sends the rest
again with the same request ids (:mod:`mlpair.jobs.chunks`); the rows a killed run had decided come
back replayed, identical, and nothing is decided twice.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import grpc
import pyarrow as pa
import pyarrow.compute as pc

from mlpair.jobs.chunks import ChunkRefused, decide_chunk_retrying
from mlpair.jobs.keys import check_keys
from mlpair.jobs.metrics import JobMetrics
from mlpair.jobs.outputs import assemble, write_part
from mlpair.jobs.progress import Progress
from mlpair.jobs.sources import Source
from mlpair.jobs.state import ChunkRecord, JobState, iso

if TYPE_CHECKING:
    from mlpair.client import PredictionClient

MAX_MESSAGE_BYTES = 256 << 20
"""The largest chunk or answer the job's channel carries (a chunk of many wide rows)."""


def job_client(target: str, credentials: grpc.ChannelCredentials | None, timeout_s: float) -> PredictionClient:
    """The client a job sends its chunks through: ``timeout_s`` is each chunk's deadline, and its
    channel carries chunks and answers of up to :data:`MAX_MESSAGE_BYTES`."""
    from mlpair.client import PredictionClient

    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]
    return PredictionClient(target, credentials=credentials, timeout_s=timeout_s, options=options)


class JobStopped(Exception):
    """The job stopped before its end (a refused chunk, a bad chunk, a failed stream, a changed
    input); the finished chunks are kept and a rerun of the same command resumes. One line."""


@dataclass(frozen=True)
class JobSpec:
    """What to score and where (see ``mlpair score --help`` for each).

    Attributes:
        chunk_rows: rows per chunk (and per part file).
        parallel: chunks in flight to the service at once.
        chunk_timeout_s: each chunk's deadline, seconds.
        wait_s: how long to wait for PredictionService to report SERVING before the first chunk
            (plaintext only; 0 = do not wait).
    """

    job_id: str
    source: Source
    model: str
    key_column: str
    entity_column: str | None
    chunk_rows: int
    state_dir: Path
    target: str
    output: str | None = None
    output_table: str | None = None
    database_url: str | None = None
    deadline: float | None = None
    parallel: int = 2
    chunk_timeout_s: float = 300.0
    metrics_file: Path | None = None
    pushgateway: str | None = None
    credentials: grpc.ChannelCredentials | None = None
    wait_s: float = 60.0

    @property
    def job_dir(self) -> Path:
        """The job's own folder under ``state_dir``: its state file and part files."""
        return self.state_dir / self.job_id

    @property
    def output_name(self) -> str:
        """Where the output goes, in words for messages: the output file, else the PostgreSQL table."""
        return self.output or f"postgresql table {self.output_table}"


def open_state(spec: JobSpec, out: TextIO) -> JobState:
    """The job's state: a new one, or the one a previous run left (with another chunk size, its
    finished chunks are forgotten: chunks are numbered by size)."""
    path = spec.job_dir / "state.json"
    now = time.time()
    if not path.exists():
        return JobState(
            spec.job_id,
            spec.source.name,
            spec.model,
            spec.key_column,
            spec.entity_column,
            spec.chunk_rows,
            spec.source.total_rows,
            spec.source.total_exact,
            spec.output_name,
            started_at=now,
            run_started_at=now,
            deadline=spec.deadline,
        )
    state = JobState.load(path)
    if (state.model, state.key_column) != (spec.model, spec.key_column):
        raise JobStopped(
            f"job {spec.job_id} was started with --model {state.model} --key {state.key_column}: "
            "rerun it with those, or give another --job-id"
        )
    if state.chunk_rows != spec.chunk_rows:
        # chunks are numbered by size: finished ones are sent again, their rows come back replayed
        print(
            f"job {spec.job_id}: --chunk-rows {state.chunk_rows} -> {spec.chunk_rows}: its {len(state.chunks)} "
            "finished chunks are sent again (their rows come back replayed, nothing is decided twice)",
            file=out,
        )
        state.chunk_rows, state.chunks = spec.chunk_rows, {}
        shutil.rmtree(spec.job_dir / "parts", ignore_errors=True)
    state.deadline = spec.deadline if spec.deadline is not None else state.deadline
    state.total_rows = spec.source.total_rows
    return state


def run(spec: JobSpec, out: TextIO = sys.stderr) -> JobState:
    """Runs (or resumes) the job to its end: every chunk decided, the output assembled.

    Before anything is sent, every key of the input is checked (:func:`~mlpair.jobs.keys.check_keys`:
    none null, none repeated, in any chunk) and so is every chunk a previous run finished (the same
    rows and first and last keys). With no chunk left to send (a finished job written to another
    output) the output is assembled without PredictionService.

    Returns:
        The finished job's state.

    Raises:
        JobStopped: a chunk was refused by the service or could not be built, the service could not
            be reached after :data:`RETRIES` tries, or the input changed since the job started; the
            message says what, and that a rerun resumes.
        InputError: a null or repeated key (nothing sent), or the input cannot be read on.
    """
    from mlpair.client import wait_until_serving

    state = open_state(spec, out)
    state_path = spec.job_dir / "state.json"
    keys = check_keys(spec.source, spec.key_column, spec.entity_column)
    state.total_rows, state.total_exact = keys.rows, True
    total = -(-keys.rows // state.chunk_rows)
    if keys.keys is not None:  # a file's keys are held: its finished chunks are checked before anything is sent
        for n, done in sorted(state.chunks.items(), key=lambda item: int(item[0])):
            _check_unchanged(spec.job_id, int(n), done, keys.chunk_bounds(int(n), state.chunk_rows))
    left = total - sum(int(n) < total for n in state.chunks)
    if state.finished_at is not None and spec.output is not None and Path(spec.output).exists():
        print(f"job {spec.job_id} finished at {iso(state.finished_at)}; its decisions are in {spec.output}", file=out)
        return state
    if left == 0:  # nothing to send: the output is assembled from the parts alone
        return _assemble(spec, state, state_path, JobMetrics(state, spec.metrics_file, spec.pushgateway), total, out)
    if spec.credentials is None and spec.wait_s > 0 and not wait_until_serving(spec.target, spec.wait_s):
        raise JobStopped(
            f"PredictionService at {spec.target} is not SERVING after {spec.wait_s:g} s "
            f"(`mlpair health --target {spec.target}`); start it and rerun"
        )
    if state.runs:  # a job run before: this is its next run (the rate and the estimate are this run's)
        state.run_started_at, state.run_rows, state.run_ended_at, state.stopped = time.time(), 0, None, ""
    state.runs, state.finished_at = state.runs + 1, None
    metrics = JobMetrics(state, spec.metrics_file, spec.pushgateway)
    state.save(state_path)
    metrics.report()
    progress = Progress(spec.job_id, state, out)
    with (
        job_client(spec.target, spec.credentials, spec.chunk_timeout_s) as client,
        ThreadPoolExecutor(max_workers=spec.parallel, thread_name_prefix="score") as pool,
        progress,
    ):
        job = _Run(spec, state, state_path, metrics, progress, out)
        chunks = job.send_all(client, pool)
    return _assemble(spec, state, state_path, metrics, chunks, out)


def _assemble(
    spec: JobSpec, state: JobState, state_path: Path, metrics: JobMetrics, chunks: int, out: TextIO
) -> JobState:
    """The output written from the ``chunks`` parts, the job recorded finished (a job finished
    before keeps its end: writing it to another output decides nothing)."""
    finished, state.finished_at = state.finished_at, None
    rows = assemble(
        spec.job_dir,
        chunks,
        job_id=spec.job_id,
        key_column=spec.key_column,
        output=spec.output,
        output_table=spec.output_table,
        database_url=spec.database_url,
    )
    state.finished_at = finished or time.time()
    state.run_ended_at = state.run_ended_at if finished else state.finished_at
    state.stopped = ""
    state.total_rows, state.total_exact = rows, True
    state.save(state_path)
    metrics.report()
    counts = ", ".join(f"{state.rows(o):,} {o}" for o in ("decided", "replayed", "failed"))
    print(f"job {spec.job_id}: {rows:,} rows ({counts}) in {spec.output_name}", file=out)
    return state


class _Run:
    """One run's loop: submit chunks, keep each finished one, stop cleanly on the first failure."""

    def __init__(
        self, spec: JobSpec, state: JobState, path: Path, metrics: JobMetrics, progress: Progress, out: TextIO
    ) -> None:
        self.spec, self.state, self.path, self.metrics, self.progress, self.out = (
            spec,
            state,
            path,
            metrics,
            progress,
            out,
        )
        self.warned_late = False
        self.last_report = 0.0

    def send_all(self, client: Any, pool: ThreadPoolExecutor) -> int:
        """Sends every chunk not done yet; returns the number of chunks of the input."""
        spec, state = self.spec, self.state
        in_flight: deque[tuple[int, Future[tuple[pa.Table, set[str]]], pa.Table]] = deque()
        chunks = 0
        try:
            for n, table in enumerate(spec.source.chunks(state.chunk_rows, spec.key_column)):
                chunks = n + 1
                done = state.chunks.get(str(n))
                if done is not None:
                    keys = table.column(spec.key_column)
                    _check_unchanged(
                        spec.job_id, n, done, (table.num_rows, str(keys[0].as_py()), str(keys[-1].as_py()))
                    )
                    continue
                in_flight.append((n, pool.submit(self._decide, client, table), table))
                while len(in_flight) > spec.parallel:
                    self._keep(*in_flight.popleft())
            while in_flight:
                self._keep(*in_flight.popleft())
        except BaseException as exc:
            for _, future, _ in in_flight:
                future.cancel()
            self.state.run_ended_at = time.time()
            for item in in_flight:  # chunks the service finished are kept: less to send again
                if not item[1].cancelled() and item[1].exception() is None:
                    with contextlib.suppress(JobStopped, OSError):
                        self._keep(*item)
            self.state.stopped = str(exc) if isinstance(exc, Exception) else f"interrupted: {type(exc).__name__}"
            self.state.save(self.path)
            self.metrics.report()
            raise
        return chunks

    def _decide(self, client: Any, table: pa.Table) -> tuple[pa.Table, set[str]]:
        spec = self.spec
        warnings: set[str] = set()
        decisions = decide_chunk_retrying(
            client,
            table,
            job_id=spec.job_id,
            key_column=spec.key_column,
            entity_column=spec.entity_column,
            model_name=spec.model,
            warnings=warnings,
        )
        return decisions, warnings

    def _keep(self, n: int, future: Future[tuple[pa.Table, set[str]]], table: pa.Table) -> None:
        rows = f"rows {n * self.state.chunk_rows:,}-{n * self.state.chunk_rows + table.num_rows - 1:,}"
        try:
            decisions, warnings = future.result()
        except ChunkRefused as exc:
            raise JobStopped(f"chunk {n} ({rows}) {exc}; fix the input and rerun the same command to resume") from exc
        except (KeyError, ValueError) as exc:
            raise JobStopped(f"chunk {n} ({rows}): {str(exc).strip(chr(39))}; fix the input and rerun") from exc
        except grpc.RpcError as exc:
            raise JobStopped(
                f"chunk {n} ({rows}): PredictionService at {self.spec.target}: {exc.code().name}: {exc.details()} "
                f"(is it up? `mlpair health --target {self.spec.target}`); rerun the same command to resume"
            ) from exc
        for text in sorted(warnings - set(self.state.warnings)):  # each distinct warning once per job
            self.state.warnings.append(text)
            print(f"warning: job {self.spec.job_id}: {text}", file=self.out)
        write_part(self.spec.job_dir, n, decisions)
        failed = decisions.num_rows - decisions.column("error_code").null_count
        replayed = pc.sum(decisions.column("replayed")).as_py() or 0
        keys = table.column(self.spec.key_column)
        self.state.chunks[str(n)] = ChunkRecord(
            rows=table.num_rows,
            decided=table.num_rows - failed - replayed,
            replayed=replayed,
            failed=failed,
            first_key=str(keys[0].as_py()),
            last_key=str(keys[-1].as_py()),
        )
        self.state.run_rows += table.num_rows
        self.state.save(self.path)
        now = time.time()
        if now - self.last_report >= 1.0:
            self.metrics.report()
            self.last_report = now
        self.progress.update()
        if self.state.late(now) and not self.warned_late:
            self.warned_late = True
            estimate = self.state.estimated_completion(now)
            print(
                f"warning: job {self.spec.job_id} is estimated to finish at {iso(estimate)}, "
                f"after its deadline {iso(self.state.deadline)}",
                file=self.out,
            )


def _check_unchanged(job_id: str, n: int, done: ChunkRecord, now: tuple[int, str, str] | None) -> None:
    """Refuses an input whose chunk ``n``, finished by an earlier run, no longer holds the same rows
    and first and last keys (``now``; None: the input no longer reaches that chunk)."""
    if now == (done.rows, done.first_key, done.last_key):
        return
    held = f"{now[1]}..{now[2]} ({now[0]} rows)" if now is not None else "no rows"
    raise JobStopped(
        f"the input changed since job {job_id} started: chunk {n} held keys "
        f"{done.first_key}..{done.last_key} ({done.rows} rows), now {held}; "
        "score it as a new job (--job-id NAME)"
    )
