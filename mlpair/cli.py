"""The ``mlpair`` command: train, migrate, serve inference, serve prediction, predict, attributes, demo,
health, drift-report.

Every server setting is a flag and an environment variable (``INFERENCE_*`` /
``PREDICTION_*``); a flag wins over the environment, which wins over the default.

Failures are one line on stderr: exit 2 for a configuration error the user can fix (the line
names the setting or command that fixes it), 1 for anything else; ``mlpair --debug …`` adds
the traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import typing
from pathlib import Path

from pydantic_settings import BaseSettings

DEFAULT_SCHEMAS = [Path("config/credit-risk/feature-schema.toml"), Path("config/churn/feature-schema.toml")]
DRIFT_NO_VERDICT = 3  # `mlpair drift-report`: some model has too few decisions for a verdict yet
# `mlpair --debug`: tracebacks on stderr (set once in main(); MLPAIR_DEBUG carries it to the workers
# a supervisor spawns, which import this module afresh)
_debug = os.environ.get("MLPAIR_DEBUG") == "1"


def _add_settings_flags(parser: argparse.ArgumentParser, settings_cls: type[BaseSettings], prefix: str) -> None:
    """One ``--flag`` per settings field, documented by the field's docstring."""
    for name, field in settings_cls.model_fields.items():
        env = f"{prefix}{name.upper()}"
        flag = "--" + name.replace("_", "-")
        is_list = typing.get_origin(field.annotation) is list
        is_dict = typing.get_origin(field.annotation) is dict
        parser.add_argument(
            flag,
            dest=name,
            default=None,
            nargs="*" if is_list else None,
            type=json.loads if is_dict else None,
            help=f"{field.description} [env {env}; default {field.default!r}]",
        )


def _settings(settings_cls: type[BaseSettings], args: argparse.Namespace) -> BaseSettings:
    """The settings from flags, then the environment, then defaults.

    Raises:
        StartupError: a value is invalid; one line naming each offending flag and variable.
    """
    from pydantic import ValidationError

    from mlpair.startup import invalid_settings

    given = {k: v for k, v in vars(args).items() if k in settings_cls.model_fields and v is not None}
    try:
        return settings_cls(**given)
    except ValidationError as exc:
        raise invalid_settings(settings_cls, exc) from exc


def _serve_inference(args: argparse.Namespace) -> int:
    from mlpair.inference.settings import InferenceSettings
    from mlpair.workers import gpu_visible

    settings = _settings(InferenceSettings, args)
    # the torch runtime follows execution_provider too; "auto" takes a GPU when one is visible
    on_gpu = settings.execution_provider == "cuda" or (settings.execution_provider == "auto" and gpu_visible())
    return _run_server("inference", settings, _inference, on_gpu=on_gpu)


def _serve_prediction(args: argparse.Namespace) -> int:
    from mlpair.prediction.settings import PredictionSettings

    settings = _settings(PredictionSettings, args)
    return _run_server("prediction", settings, _prediction)


# The servers are imported only once the port is known to be free: a refusal comes in about a
# second, not after the imports of ONNX Runtime, SQLAlchemy and SciPy.
async def _inference(settings, *, shared_port: bool = False) -> None:
    from mlpair.inference.server import serve

    await serve(settings, shared_port=shared_port)


async def _prediction(settings, *, shared_port: bool = False) -> None:
    from mlpair.prediction.server import serve

    await serve(settings, shared_port=shared_port)


def _run_server(layer: str, settings, serve, *, on_gpu: bool = False) -> int:
    """One serving process, or a supervisor of ``settings.workers`` of them (:mod:`mlpair.workers`)."""
    import functools

    from mlpair.logs import configure_logging
    from mlpair.startup import StartupError
    from mlpair.workers import supervise, worker_count

    configure_logging(layer, settings.log_level, settings.log_format, sample_ratio=settings.log_sample_ratio)
    try:
        workers = worker_count(settings.workers, uses_gpu=on_gpu)
        if workers > 1:
            return supervise(
                layer, settings, workers, functools.partial(_serve_process, layer, serve=serve, shared_port=True)
            )
    except StartupError as exc:
        return _fail(f"{layer} service", exc, 2)
    return _serve_process(layer, settings, serve)


def _serve_process(layer: str, settings, serve, *, shared_port: bool = False) -> int:
    """Serves until SIGTERM: alone (exclusive port, own metrics port), or as a supervisor's worker
    (``shared_port``: a fresh interpreter; the supervisor owns the port check and the metrics port)."""
    from importlib.metadata import version

    from mlpair.logs import configure_logging
    from mlpair.startup import StartupError
    from mlpair.workers import check_port_free, port_error

    if shared_port:
        configure_logging(layer, settings.log_level, settings.log_format, sample_ratio=settings.log_sample_ratio)
    else:
        try:
            check_port_free(settings.host, settings.port)  # at once, before any model or database work
        except StartupError as exc:
            return _fail(f"{layer} service", exc, 2)

    from opentelemetry import trace

    from mlpair.observability.tracing import build_tracer_provider

    # The standard OTEL_* variables fill in what the project's own settings leave unset.
    sample_ratio = settings.trace_sample_ratio if "trace_sample_ratio" in settings.model_fields_set else None
    provider = build_tracer_provider(
        f"mlpair-{layer}",
        otlp_endpoint=settings.otlp_endpoint,
        sample_ratio=sample_ratio,
        service_version=version("mlpair"),
        environ=os.environ,
    )
    trace.set_tracer_provider(provider)
    try:
        if not shared_port and settings.metrics_port:
            from prometheus_client import start_http_server

            try:
                start_http_server(settings.metrics_port, addr=settings.host)
            except OSError as exc:
                raise port_error(settings.host, settings.metrics_port, exc, "metrics port") from exc
        asyncio.run(serve(settings, shared_port=shared_port))
    except StartupError as exc:  # the user can fix it: one line, exit 2
        return _fail(f"{layer} service", exc, 2)
    except Exception as exc:  # noqa: BLE001  (anything else: one line, exit 1, the traceback with --debug)
        return _fail(f"{layer} service failed to start", exc, 1)
    finally:
        provider.shutdown()  # flushes spans still batched for export
    return 0


def _train(args: argparse.Namespace) -> int:
    import dataclasses
    import logging

    from mlpair.logs import configure_logging
    from mlpair.training.pipeline import load_train_config, train_family

    configure_logging("training", "INFO")
    schemas = [Path(s) for s in args.schema or DEFAULT_SCHEMAS]
    if missing := [str(s) for s in schemas if not s.is_file()]:
        print(
            f"mlpair: no feature schema at {', '.join(missing)} (paths are relative to {Path.cwd()}); "
            "run from the repository root or pass --schema",
            file=sys.stderr,
        )
        return 2
    for schema in schemas:
        config = load_train_config(Path(schema))
        if args.seed is not None:
            config = dataclasses.replace(config, seed=args.seed)
        entry, fresh = train_family(Path(schema), Path(args.model_repository), config, force=args.force)
        m = entry.manifest
        cal = m.metrics["holdout_calibrated"]
        logging.getLogger("mlpair").info(
            "%s version %s %s: holdout ROC AUC %.4f, Brier %.4f, ECE %.4f (calibration %s)",
            m.model_name,
            m.model_version,
            "trained" if fresh else "reused (up to date)",
            cal["roc_auc"],
            cal["brier"],
            cal["ece_15"],
            m.calibration.method,
        )
    return 0


def _migrate(args: argparse.Namespace) -> int:
    import logging

    from mlpair.logs import configure_logging
    from mlpair.prediction.crm.admin import migrate
    from mlpair.prediction.settings import PredictionSettings

    configure_logging("prediction", "WARNING")
    defaults = PredictionSettings()  # PREDICTION_LEDGER_URL and PREDICTION_CRM_URL, as the services read them
    ledger_url, crm_url = args.ledger_url or defaults.ledger_url, args.crm_url or defaults.crm_url
    try:
        report = asyncio.run(
            migrate(
                ledger_url,
                crm_url,
                serving_role=args.serving_role,
                import_outboxes=[Path(p) for p in args.import_outbox or []],
                backfill_from_crm=args.backfill_from_crm,
            )
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"mlpair migrate: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001  (a database refused or is unreachable: one line, detail with --debug)
        if _debug:
            logging.getLogger("mlpair").error("migration failed", exc_info=True)
        print(
            f"mlpair migrate: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'failed'}",
            file=sys.stderr,
        )
        return 1
    print(
        f"ledger at {report.revisions['ledger']}, CRM at {report.revisions['crm']}"
        + (f"; serving role {report.granted_to} granted" if report.granted_to else "")
        + (f"; {report.imported_from_outboxes} decision(s) imported from outboxes" if args.import_outbox else "")
        + (f"; {report.backfilled_from_crm} decision(s) backfilled from the CRM" if args.backfill_from_crm else "")
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from mlpair.demo import run_demo

    return run_demo(
        Path(args.model_repository), Path(args.workdir), Path(args.config_dir), concurrency=args.concurrency
    )


def _health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(args.target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s
            )
        except grpc.RpcError as exc:
            print(f"{args.target}: {exc.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.target}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _drift_report(args: argparse.Namespace) -> int:
    import json
    import urllib.request
    from dataclasses import asdict

    from mlpair.prediction.drift_report import render, reports_from_metrics

    try:
        with urllib.request.urlopen(args.metrics_url, timeout=args.timeout_s) as reply:
            text = reply.read().decode()
    except OSError as exc:
        print(f"mlpair: cannot read {args.metrics_url}: {exc}", file=sys.stderr)
        return 1
    reports = reports_from_metrics(text)
    if args.json:
        print(json.dumps([{**asdict(r), "judged": r.judged, "drifted": r.drifted} for r in reports], indent=2))
    else:
        print(render(reports))
    if any(r.drifted for r in reports):
        return 2
    return DRIFT_NO_VERDICT if not reports or not all(r.judged for r in reports) else 0


def _predict(args: argparse.Namespace) -> int:
    import grpc

    from mlpair.client import parse_attributes, predict, render
    from mlpair.rpc import channel_credentials
    from mlpair.startup import StartupError

    try:
        attributes = parse_attributes(args.attr or [])
        credentials = channel_credentials(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)
    except (ValueError, OSError) as exc:
        raise StartupError(str(exc)) from exc
    try:
        reply = predict(
            args.target,
            args.family,
            attributes,
            request_id=args.request_id,
            entity_id=args.entity_id,
            explain=args.explain,
            timeout_s=args.timeout_s,
            credentials=credentials,
        )
    except grpc.RpcError as exc:
        print(f"mlpair predict: {args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(render(reply))
    return 0


def _attributes(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from mlpair.attributes import attribute_rows, markdown

    rows = attribute_rows(Path(args.config_dir), Path(args.model_repository))
    if args.markdown:
        print(markdown(rows), end="")
        return 0
    for family in dict.fromkeys(r.family for r in rows):
        table = Table(title=family, title_justify="left")
        table.add_column("attribute", no_wrap=True)
        for column in ("meaning", "type", "unit", "range", "accepted values"):
            table.add_column(column)
        for r in rows:
            if r.family == family:
                table.add_row(r.name, r.label, r.type, r.unit, r.range, r.accepted.replace("`", ""))
        Console().print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from mlpair.inference.settings import InferenceSettings
    from mlpair.prediction.settings import PredictionSettings

    parser = argparse.ArgumentParser(prog="mlpair", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="print the traceback of a failure")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train model families on real data into the model repository")
    train.add_argument(
        "--schema", action="append", help="feature schema file (repeatable) [default: credit-risk and churn]"
    )
    train.add_argument("--model-repository", default="var/models", help="repository root [default: var/models]")
    train.add_argument("--force", action="store_true", help="train a new version even if the latest is up to date")
    train.add_argument(
        "--seed",
        type=int,
        default=None,
        help="weight-initialisation seed instead of the family's training.toml one (an ensemble member; "
        "the data split stays the same)",
    )
    train.set_defaults(func=_train)

    migrate = sub.add_parser(
        "migrate",
        help="create or upgrade the decision ledger and CRM schemas, as their owner "
        "(before each deploy: the services never migrate)",
    )
    migrate.add_argument(
        "--ledger-url",
        default=None,
        help="decision ledger URL [env PREDICTION_LEDGER_URL; default as `serve prediction`]",
    )
    migrate.add_argument(
        "--crm-url", default=None, help="CRM database URL [env PREDICTION_CRM_URL; default as `serve prediction`]"
    )
    migrate.add_argument(
        "--serving-role",
        default=None,
        help="PostgreSQL role the services connect as: granted exactly what they use, no DDL",
    )
    migrate.add_argument(
        "--import-outbox",
        action="append",
        metavar="FILE",
        help="an outbox file of the previous release (per-pod SQLite) whose decisions join the ledger (repeatable)",
    )
    migrate.add_argument(
        "--backfill-from-crm",
        action="store_true",
        help="add every CRM decision the ledger lacks (once, when moving to the shared ledger)",
    )
    migrate.set_defaults(func=_migrate)

    serve = sub.add_parser("serve", help="run one of the two services")
    roles = serve.add_subparsers(dest="role", required=True)
    inference = roles.add_parser("inference", help="InferenceService: raw logits over gRPC")
    _add_settings_flags(inference, InferenceSettings, "INFERENCE_")
    inference.set_defaults(func=_serve_inference)
    prediction = roles.add_parser("prediction", help="PredictionService: decisions over gRPC")
    _add_settings_flags(prediction, PredictionSettings, "PREDICTION_")
    prediction.set_defaults(func=_serve_prediction)

    demo = sub.add_parser("demo", help="train, start both services, score every holdout applicant, summarise, stop")
    demo.add_argument("--model-repository", default="var/models", help="repository root [default: var/models]")
    demo.add_argument("--workdir", default="var/demo", help="CRM database and service logs [default: var/demo]")
    demo.add_argument("--config-dir", default="config", help="schemas and policies [default: config]")
    demo.add_argument("--concurrency", type=int, default=32, help="Predict calls in flight [default: 32]")
    demo.set_defaults(func=_demo)

    health = sub.add_parser("health", help="grpc.health.v1 check; exit 0 only when SERVING")
    health.add_argument("--target", default="127.0.0.1:8001", help="host:port [default: 127.0.0.1:8001]")
    health.add_argument("--service", default="", help="service name; empty = overall")
    health.add_argument("--timeout-s", type=float, default=2.0, help="seconds to wait [default: 2]")
    health.set_defaults(func=_health)

    predict = sub.add_parser(
        "predict", help="one decision from a running PredictionService: decision, reasons, probability"
    )
    predict.add_argument(
        "--family", required=True, help="model family, e.g. credit-risk (`mlpair attributes` lists them)"
    )
    predict.add_argument(
        "--attr",
        action="append",
        metavar="NAME=VALUE",
        help="one raw attribute (repeatable); a number travels as a number, NAME= as missing",
    )
    predict.add_argument(
        "--target", default="127.0.0.1:9001", help="PredictionService host:port [default: 127.0.0.1:9001]"
    )
    predict.add_argument("--request-id", default="", help="idempotency key [default: a new UUID]")
    predict.add_argument("--entity-id", required=True, help="the entity decided about (stored with the decision)")
    predict.add_argument("--explain", action="store_true", help="also print the top reasons in business language")
    predict.add_argument("--timeout-s", type=float, default=10.0, help="deadline in seconds [default: 10]")
    predict.add_argument(
        "--tls-ca-file", type=Path, default=None, help="CA of the server's certificate: TLS instead of plaintext"
    )
    predict.add_argument(
        "--tls-cert-file", type=Path, default=None, help="client certificate (mTLS; with --tls-key-file)"
    )
    predict.add_argument("--tls-key-file", type=Path, default=None, help="client private key (mTLS)")
    predict.set_defaults(func=_predict)

    attributes = sub.add_parser("attributes", help="each family's attributes: type, unit, range, accepted categories")
    attributes.add_argument("--config-dir", default="config", help="schemas [default: config]")
    attributes.add_argument(
        "--model-repository",
        default="var/models",
        help="trained models, whose vocabularies list the categories [default: var/models]",
    )
    attributes.add_argument("--markdown", action="store_true", help="print the README's Markdown table")
    attributes.set_defaults(func=_attributes)

    drift = sub.add_parser(
        "drift-report",
        help="drift of a running PredictionService's features and scores; "
        f"exit 0 none, 2 drift, {DRIFT_NO_VERDICT} no verdict yet "
        "(too few decisions), 1 unreadable",
    )
    drift.add_argument(
        "--metrics-url",
        default="http://127.0.0.1:9002/metrics",
        help="PredictionService Prometheus endpoint [default: http://127.0.0.1:9002/metrics]",
    )
    drift.add_argument("--json", action="store_true", help="print JSON instead of a table")
    drift.add_argument("--timeout-s", type=float, default=5.0, help="seconds to wait [default: 5]")
    drift.set_defaults(func=_drift_report)
    return parser


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _fail(what: str, exc: BaseException, code: int) -> int:
    """Prints ``mlpair: <what>: <reason>`` on stderr (the traceback too with ``--debug``); returns ``code``."""
    import traceback

    from mlpair.startup import StartupError

    if _debug:
        traceback.print_exception(exc, file=sys.stderr)
    reason = _one_line(exc) if isinstance(exc, StartupError) else f"{type(exc).__name__}: {_one_line(exc)}"
    hint = "" if _debug or code == 2 else " (mlpair --debug … for the traceback)"
    print(f"mlpair: {what}: {reason}{hint}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Runs one command; returns its exit code (0 success, 2 configuration error, 1 other failure)."""
    global _debug
    from mlpair.startup import StartupError

    args = build_parser().parse_args(argv)
    _debug = args.debug or _debug
    if _debug:
        os.environ["MLPAIR_DEBUG"] = "1"
    what = f"{args.role} service" if args.command == "serve" else args.command
    try:
        return args.func(args)
    except StartupError as exc:
        return _fail(what, exc, 2)
    except Exception as exc:  # noqa: BLE001  (one line, not a traceback: --debug shows it)
        return _fail(what, exc, 1)


if __name__ == "__main__":
    sys.exit(main())
