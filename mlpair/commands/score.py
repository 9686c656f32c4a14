"""``mlpair score``: decide every row of a Parquet or CSV file or a PostgreSQL query through a running
PredictionService (``PredictColumns``), resumably, and write the decisions (:mod:`mlpair.jobs`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_TARGET = "127.0.0.1:9001"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers ``mlpair score`` and its flags on the ``mlpair`` subcommands."""
    score = sub.add_parser(
        "score",
        help="decide every row of a Parquet/CSV file or a PostgreSQL query through PredictionService, "
        "in resumable chunks; or --status JOB",
    )
    score.add_argument("--input", help="Parquet (.parquet) or CSV (.csv) file of one row per applicant")
    score.add_argument("--query", help="PostgreSQL query instead of --input (read ordered by --key)")
    score.add_argument("--database-url", help="PostgreSQL of --query and --output-table (postgresql://…)")
    score.add_argument("--key", help="column identifying each row (unique): with the job id, its request id")
    score.add_argument("--entity-column", help="column of the entity decided about [default: --key]")
    score.add_argument("--model", default="credit-risk", help="model family [default: credit-risk]")
    score.add_argument(
        "--target", default=DEFAULT_TARGET, help=f"PredictionService host:port [default: {DEFAULT_TARGET}]"
    )
    score.add_argument("--output", help="decisions file: .parquet or .csv")
    score.add_argument("--output-table", help="decisions into this PostgreSQL table (with --database-url)")
    score.add_argument("--chunk-rows", type=int, default=10_000, help="rows per chunk [default: 10000]")
    score.add_argument("--parallel", type=int, default=2, help="chunks in flight at once [default: 2]")
    score.add_argument("--chunk-timeout-s", type=float, default=300.0, help="deadline of one chunk [default: 300]")
    score.add_argument(
        "--job-id",
        help="the job's id [default: derived from the input's path (or query), model and key: a plain rerun, "
        "also of a fixed file, resumes]",
    )
    score.add_argument("--state-dir", default="var/jobs", help="job states and part files [default: var/jobs]")
    score.add_argument(
        "--deadline",
        help="when the job must be done: ISO timestamp, or HH:MM (its next occurrence, UTC)",
    )
    score.add_argument("--metrics-file", type=Path, help="Prometheus textfile (node_exporter) for the job's metrics")
    score.add_argument("--pushgateway", help="also push the job's metrics to this Prometheus Pushgateway")
    score.add_argument(
        "--wait-s", type=float, default=60.0, help="wait this long for PredictionService to be SERVING [default: 60]"
    )
    score.add_argument("--status", metavar="JOB", help="print job JOB's state and exit")
    score.add_argument(
        "--tls-ca-file", type=Path, default=None, help="CA of the server's certificate: TLS instead of plaintext"
    )
    score.add_argument("--tls-cert-file", type=Path, default=None, help="client certificate (mTLS)")
    score.add_argument("--tls-key-file", type=Path, default=None, help="client private key (mTLS)")
    score.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="local: this process; ray: a Ray cluster's workers over the input's partitions, --output a "
        "folder of Parquet files (the score-ray extra) [default: local]",
    )
    score.add_argument(
        "--ray-address",
        help="Ray cluster: head host:port, ray://..., auto, or local (a new one on this machine) "
        "[default: RAY_ADDRESS, else local]",
    )
    score.add_argument("--ray-actors", type=int, default=2, help="scoring workers on the Ray cluster [default: 2]")
    score.set_defaults(func=score_command)


def score_command(args: argparse.Namespace) -> int:
    """``mlpair score``.

    Returns:
        0 when the job finished (or ``--status`` printed one); 1 when it stopped before its end
        (one line on stderr: the refused chunk and its reason, or the unreachable service; a rerun
        of the same command resumes).

    Raises:
        StartupError: bad flags or input (no such file, no key column, an unreadable file): exit 2.
    """
    from mlpair.jobs.chunks import check_job_id
    from mlpair.jobs.local import JobSpec, JobStopped, run
    from mlpair.jobs.outputs import check_output
    from mlpair.jobs.sources import default_job_id, open_source
    from mlpair.jobs.state import JobState, parse_deadline
    from mlpair.rpc import channel_credentials
    from mlpair.startup import StartupError

    state_dir = Path(args.state_dir)
    if args.status:
        print("\n".join(JobState.load(state_dir / args.status / "state.json").status_lines()))
        return 0
    if not args.key:
        raise StartupError("--key COLUMN is required: the column that identifies each row")
    if args.chunk_rows < 1 or args.parallel < 1:
        raise StartupError("--chunk-rows and --parallel must be at least 1")
    if args.engine == "ray":
        return _score_on_ray(args)
    check_output(args.output, args.output_table, args.database_url)
    deadline = parse_deadline(args.deadline) if args.deadline else None
    source = open_source(args.input, args.query, args.database_url, args.key, args.entity_column)
    job_id = args.job_id or default_job_id(source, args.model, args.key, args.entity_column)
    try:
        check_job_id(job_id)
        credentials = channel_credentials(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)
    except (ValueError, OSError) as exc:
        raise StartupError(str(exc)) from exc
    spec = JobSpec(
        job_id=job_id,
        source=source,
        model=args.model,
        key_column=args.key,
        entity_column=args.entity_column,
        chunk_rows=args.chunk_rows,
        state_dir=state_dir,
        target=args.target,
        output=args.output,
        output_table=args.output_table,
        database_url=args.database_url,
        deadline=deadline,
        parallel=args.parallel,
        chunk_timeout_s=args.chunk_timeout_s,
        metrics_file=args.metrics_file,
        pushgateway=args.pushgateway,
        credentials=credentials,
        wait_s=args.wait_s,
    )
    print(f"job {job_id}: {source.name} ({source.total_rows:,} rows) -> {spec.output_name}", file=sys.stderr)
    try:
        run(spec)
    except JobStopped as exc:
        print(f"mlpair score: job {job_id} stopped: {exc}", file=sys.stderr)
        return 1
    return 0


def _score_on_ray(args: argparse.Namespace) -> int:
    """``mlpair score --engine ray``: the job on a Ray cluster (:mod:`mlpair.jobs.ray_engine`).

    Returns:
        0 when every row is in the output folder; 1 when the run stopped (one line on stderr; a rerun
        of the same command resumes, the rows decided before replayed from the ledger).

    Raises:
        StartupError: Ray is not installed, or bad flags (no --input or --output, a query, no --job-id
            for an input that is not a local file): exit 2.
    """
    from mlpair.client import wait_until_serving
    from mlpair.jobs.chunks import check_job_id
    from mlpair.jobs.local import JobStopped
    from mlpair.startup import StartupError

    try:
        from mlpair.jobs import ray_engine
    except ImportError as exc:
        raise StartupError(
            f"--engine ray needs Ray: from a checkout, .venv/bin/pip install -e '.[score-ray]' ({exc})"
        ) from exc
    if args.query or not args.input or not args.output:
        raise StartupError(
            "--engine ray reads --input (Parquet or CSV: a file, a folder or a URI) into --output (a folder)"
        )
    if args.ray_actors < 1:
        raise StartupError("--ray-actors must be at least 1")
    job_id = args.job_id
    if job_id is None:
        if not Path(args.input).is_file():
            raise StartupError("--job-id is required with --engine ray unless --input is a local file")
        from mlpair.jobs.sources import default_job_id, open_source

        source = open_source(args.input, None, None, args.key, args.entity_column)
        job_id = default_job_id(source, args.model, args.key, args.entity_column)
    try:
        check_job_id(job_id)
        spec = ray_engine.RayJobSpec(
            job_id=job_id,
            input=args.input,
            output=args.output,
            model=args.model,
            key_column=args.key,
            entity_column=args.entity_column,
            target=args.target,
            address=args.ray_address,
            batch_rows=args.chunk_rows,
            actors=args.ray_actors,
            chunk_timeout_s=args.chunk_timeout_s,
            tls_ca=ray_engine.read_pem(args.tls_ca_file),
            tls_cert=ray_engine.read_pem(args.tls_cert_file),
            tls_key=ray_engine.read_pem(args.tls_key_file),
        )
    except (ValueError, OSError) as exc:
        raise StartupError(str(exc)) from exc
    plaintext = args.tls_ca_file is None
    if plaintext and args.wait_s > 0 and not wait_until_serving(args.target, args.wait_s):
        print(
            f"mlpair score: PredictionService at {args.target} is not SERVING after {args.wait_s:g} s", file=sys.stderr
        )
        return 1
    print(f"job {job_id}: {args.input} -> {args.output} on Ray", file=sys.stderr)
    try:
        ray_engine.run_ray_job(spec)
    except (JobStopped, ValueError) as exc:
        print(f"mlpair score: job {job_id} stopped: {exc}", file=sys.stderr)
        return 1
    return 0
