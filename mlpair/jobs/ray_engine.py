"""The batch-scoring job on a Ray cluster (``mlpair score --engine ray``): for inputs beyond one machine.

The same job as :mod:`mlpair.jobs.local`, over partitions: Ray Data reads the Parquet or CSV input
(one file, a folder of files, or an object-store URI the cluster can read), cuts it into batches of
``batch_rows`` rows, and hands each batch to one of ``actors`` workers. Each worker holds one
:class:`~mlpair.client.PredictionClient` for its lifetime and decides its batches with
:func:`~mlpair.jobs.chunks.decide_chunk`: the request id of each row is derived from the job id and
the row's key, exactly as the local job derives it. The decisions (the key column, then the columns
of :data:`~mlpair.client.tables.DECISION_SCHEMA`) are written as Parquet files under the output
folder.

Resuming: a run that dies halfway (its driver killed, a node lost) is run again with the same job id;
every row is sent again under the same request id, the rows decided before come back replayed from
the decision ledger, and only the rest are decided now: nothing is decided twice. The output folder
is written afresh by each run (``overwrite``): a killed run's partial files never add to the rows
of the run that completes.

Ray is an optional dependency (the ``score-ray`` extra); this module is imported only when the Ray
engine is chosen.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import grpc
import pyarrow as pa

from mlpair.jobs.chunks import ChunkRefused, check_job_id, decide_chunk_retrying, describe_refusal
from mlpair.jobs.local import JobStopped, job_client

DEFAULT_BATCH_ROWS = 10_000
DEFAULT_ACTORS = 2
ACTOR_CPUS = 0
"""CPUs Ray reserves for each scoring worker: none, as it mostly waits on PredictionService, and any
share of a CPU would leave a node less than the whole CPU each read and write task asks for (the
run would stall with every node partly held); the pool's size bounds the workers instead."""


@dataclass(frozen=True)
class RayJobSpec:
    """What to score on the cluster, and where the decisions go.

    Attributes:
        job_id: the job's id; with each row's key it makes the row's request id (the same on a rerun).
        input: a Parquet or CSV file, a folder of them, or a URI the cluster's nodes can read
            (``s3://…``, ``gs://…``); CSV when it ends in ``.csv``, else Parquet.
        output: the folder (or URI) the decisions are written to as Parquet files; replaced by each run.
        model: the model family (``credit-risk``, ``churn``).
        key_column: the column identifying each row (unique, never null).
        entity_column: the entity decided about; None = the key column.
        target: PredictionService ``host:port`` as the cluster's nodes reach it.
        address: the Ray cluster (``host:port`` of its head, ``ray://…``, ``auto``, or ``local``: a
            new one on this machine); None = the one ``RAY_ADDRESS`` names (as inside a RayJob), else
            ``local`` (never another cluster that happens to be recorded on this machine).
        batch_rows: rows per ``PredictColumns`` chunk.
        actors: scoring workers (each one client, one chunk in flight).
        chunk_timeout_s: each chunk's deadline, seconds.
        tls_ca, tls_cert, tls_key: PEM bytes for TLS (the CA) and mTLS (certificate and key); they
            travel to the workers with the job, so no file needs to exist on the nodes.
    """

    job_id: str
    input: str
    output: str
    model: str
    key_column: str
    entity_column: str | None
    target: str
    address: str | None = None
    batch_rows: int = DEFAULT_BATCH_ROWS
    actors: int = DEFAULT_ACTORS
    chunk_timeout_s: float = 300.0
    tls_ca: bytes | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None


@dataclass(frozen=True)
class RayJobResult:
    """A finished run: rows written to the output, and how many of them were decided now, replayed
    from the ledger (decided by an earlier run) or failed with their own error; ``seconds``: the
    run's wall time."""

    rows: int
    decided: int
    replayed: int
    failed: int
    seconds: float


class DecideBatches:
    """Ray Data's per-worker UDF: one :class:`~mlpair.client.PredictionClient` per actor, each
    ``pyarrow.Table`` batch decided as one ``PredictColumns`` chunk (retried on UNAVAILABLE,
    DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED with the same request ids).

    Raises (from ``__call__``, failing the run):
        ChunkRefused: the service refused the batch as a whole (a bad column, an oversize chunk).
        KeyError, ValueError: the batch has no key column, a null or repeated key.
        grpc.RpcError: the service stayed unreachable through every retry.
    """

    def __init__(self, spec: RayJobSpec) -> None:
        credentials = None
        if spec.tls_ca is not None:
            credentials = grpc.ssl_channel_credentials(spec.tls_ca, spec.tls_key, spec.tls_cert)
        self.spec = spec
        self.client = job_client(spec.target, credentials, spec.chunk_timeout_s)

    def __call__(self, batch: pa.Table) -> pa.Table:
        """Decides one batch as one ``PredictColumns`` chunk and returns the key column followed by
        the decision columns (:data:`~mlpair.client.tables.DECISION_SCHEMA`), one row per input row, in
        order. A retryable status (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) is retried up to
        :data:`~mlpair.jobs.chunks.RETRIES` times with the same request ids, waiting 0.5 s doubled each time (at most 5 s).

        Raises:
            ChunkRefused: the service refused the batch as a whole (it pickles whole, so it reaches
                the driver).
            grpc.RpcError: a status that is not retryable, or one still failing after the retries.
        """
        spec = self.spec
        return decide_chunk_retrying(
            self.client,
            batch,
            job_id=spec.job_id,
            key_column=spec.key_column,
            entity_column=spec.entity_column,
            model_name=spec.model,
        )

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()


def read_input(spec: RayJobSpec) -> Any:
    """The input as a Ray Dataset (nothing read yet): CSV when ``spec.input`` ends in ``.csv`` (the
    key and entity columns read as text, as the local job reads them), else Parquet; cut into blocks
    of at most ``batch_rows`` rows as it streams, so a single file (one block as read) is shared by
    every worker rather than decided by one."""
    import ray.data

    if spec.input.lower().endswith(".csv"):
        from pyarrow import csv

        text = {name: pa.string() for name in (spec.key_column, spec.entity_column) if name}
        convert = csv.ConvertOptions(column_types=text, strings_can_be_null=True)
        dataset = ray.data.read_csv(spec.input, convert_options=convert)
    else:
        dataset = ray.data.read_parquet(spec.input)
    return dataset.repartition(target_num_rows_per_block=spec.batch_rows)


def cluster_address(address: str | None) -> str:
    """The cluster ``ray.init`` joins: ``address`` when given, else ``RAY_ADDRESS``'s, else
    ``local`` (a new cluster on this machine, stopped with the job). Never ``None``: Ray would join
    whatever cluster was last started on this machine, another user's or another job's."""
    return address or os.environ.get("RAY_ADDRESS") or "local"


def quiet_ray() -> None:
    """Ray's and Ray Data's own INFO lines (a cluster started, a dataset's plan and progress) off the
    job's terminal: warnings and errors only. ``RAY_DATA_VERBOSE=1`` keeps them."""
    if os.environ.get("RAY_DATA_VERBOSE") == "1":
        return
    for name in ("ray", "ray.data"):
        logging.getLogger(name).setLevel(logging.WARNING)


def run_ray_job(spec: RayJobSpec, out: TextIO = sys.stderr) -> RayJobResult:
    """Runs the job on the Ray cluster to its end and counts what it wrote.

    Connects to ``spec.address`` (:func:`cluster_address`; a cluster it joins keeps running, one it
    started as ``local`` stops with it), reads the input, decides every
    batch on ``spec.actors`` workers and writes the decisions under ``spec.output`` (replacing what
    was there), then reads back the output's ``replayed`` and ``error_code`` columns for the counts.

    Raises:
        ValueError: the job id cannot prefix request ids, or ``batch_rows``/``actors`` is below 1.
        JobStopped: the run failed (a refused or malformed batch, the service unreachable, the
            input unreadable); the message says what, and a rerun with the same job id resumes.
    """
    import ray
    import ray.data

    check_job_id(spec.job_id)
    if spec.batch_rows < 1 or spec.actors < 1:
        raise ValueError("batch_rows and actors must be at least 1")
    started = time.monotonic()
    quiet_ray()
    ray.init(address=cluster_address(spec.address), logging_level=logging.WARNING)
    quiet_ray()  # ray.init configures Ray Data's loggers again
    try:
        decided = read_input(spec).map_batches(
            DecideBatches,
            fn_constructor_args=(spec,),
            batch_size=spec.batch_rows,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=spec.actors),
            num_cpus=ACTOR_CPUS,
        )
        decided.write_parquet(spec.output, mode=ray.data.SaveMode.OVERWRITE)
    except Exception as exc:  # noqa: BLE001  Ray wraps the worker's error (RayTaskError, UserCodeException)
        raise JobStopped(f"job {spec.job_id} on Ray: {_cause(exc)}; rerun with the same job id to resume") from exc
    finally:
        ray.shutdown()
    result = count_output(spec.output, time.monotonic() - started)
    print(
        f"job {spec.job_id}: {result.rows:,} rows ({result.decided:,} decided, {result.replayed:,} replayed, "
        f"{result.failed:,} failed) in {spec.output} in {result.seconds:.1f} s",
        file=out,
    )
    return result


def count_output(output: str, seconds: float) -> RayJobResult:
    """Counts the decisions under ``output`` (Parquet files of the key and decision columns)."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    table = ds.dataset(output, format="parquet").to_table(columns=["replayed", "error_code"])
    failed = table.num_rows - table.column("error_code").null_count
    replayed = int(pc.sum(pc.fill_null(table.column("replayed"), False)).as_py() or 0)
    return RayJobResult(table.num_rows, table.num_rows - failed - replayed, replayed, failed, seconds)


def _cause(exc: BaseException) -> str:
    """The worker's own error in one line (a refused batch, a bad key, the service unreachable)
    rather than Ray's wrapper. A refused batch's :class:`~mlpair.jobs.chunks.ChunkRefused` pickles
    whole, so it arrives as itself in the chain; other errors are read from the traceback text Ray
    hands the driver."""
    for error in _chain(exc):
        if isinstance(error, ChunkRefused):
            return describe_refusal(error.error, error.first_key)
    text = "\n".join(str(e) for e in _chain(exc))
    refused = _WORKER_ERROR.findall(text)
    if refused:
        return refused[-1]
    status = _RPC_STATUS.search(text)
    if status:
        return f"PredictionService: {status.group(1)}: {status.group(2)}"
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = getattr(current, "cause", None) or current.__cause__
    return seen


_WORKER_ERROR = re.compile(r"^(?:[\w.]+\.)?(?:ChunkRefused|KeyError|ValueError): (.+)$", re.MULTILINE)
_RPC_STATUS = re.compile(r'status = StatusCode\.(\w+)\s+details = "([^"]*)"')


def read_pem(path: Path | None) -> bytes | None:
    """The file's bytes, or None without a path.

    Raises:
        OSError: the file cannot be read.
    """
    return path.read_bytes() if path is not None else None
