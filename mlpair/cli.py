"""The ``mlpair`` command: train, import-model, migrate, serve inference, serve prediction, relay, predict, attributes,
demo, health, drift-report, check-model, score, outcomes-import, outcomes-report, events tail.

Every server setting is a flag and an environment variable (``INFERENCE_*`` /
``PREDICTION_*``); a flag wins over the environment, which wins over the default.

Failures are one line on stderr: exit 2 for a configuration error the user can fix (the line
names the setting or command that fixes it), 1 for anything else; ``mlpair --debug …`` adds
the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic_settings import BaseSettings

# `mlpair --debug`: tracebacks on stderr (set once in main(); MLPAIR_DEBUG carries it to the workers
# a supervisor spawns, which import this module afresh)
_debug = os.environ.get("MLPAIR_DEBUG") == "1"


def debug_enabled() -> bool:
    """Whether ``mlpair --debug`` (or ``MLPAIR_DEBUG=1``) asked for tracebacks on stderr."""
    return _debug


def _json_value(text: str) -> Any:
    """A JSON flag value (a ``dict`` setting, e.g. ``--shadows '{"churn": "3"}'``)."""
    return json.loads(text)


def _add_settings_flags(
    parser: argparse.ArgumentParser,
    settings_cls: type[BaseSettings],
    prefix: str,
    only: tuple[str, ...] | None = None,
) -> None:
    """One ``--flag`` per settings field (each of ``only``, when given), documented by the field's docstring."""
    for name, field in settings_cls.model_fields.items():
        if only is not None and name not in only:
            continue
        env = f"{prefix}{name.upper()}"
        flag = "--" + name.replace("_", "-")
        is_list = typing.get_origin(field.annotation) is list
        # a dict setting takes JSON (argparse's stubs accept no ``type=None``, hence the two forms)
        parse: dict[str, Any] = {"type": _json_value} if typing.get_origin(field.annotation) is dict else {}
        parser.add_argument(
            flag,
            dest=name,
            default=None,
            nargs="*" if is_list else None,
            **parse,
            help=f"{field.description} [env {env}; default {field.default!r}]",
        )


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and flag; each subcommand's ``func`` is its implementation in :mod:`mlpair.commands`."""
    from mlpair.commands import calls, check_model, decision, events, models, operate, outcomes, score
    from mlpair.commands import serve as serving
    from mlpair.commands.operate import DRIFT_NO_VERDICT
    from mlpair.inference.settings import InferenceSettings
    from mlpair.prediction.settings import PredictionSettings

    parser = argparse.ArgumentParser(prog="mlpair", description=" ".join(__doc__.split("\n\n", 1)[0].split()))
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
    train.add_argument(
        "--publish",
        metavar="URI",
        help="then publish each version trained (or reused) to a path, s3://bucket/prefix or models:/ (see publish)",
    )
    train.set_defaults(func=models.train)

    imports = sub.add_parser(
        "import-model",
        help="make an ONNX model trained elsewhere the next version of its family: signature checked against the "
        "schema, calibration fitted on your calibration set (docs/model-format.md)",
    )
    imports.add_argument(
        "--model", required=True, help="the ONNX file: [batch, n_features] float32 -> logits [batch, 2]"
    )
    imports.add_argument("--schema", required=True, help="the family's feature schema file")
    imports.add_argument(
        "--preprocessing", required=True, help="the fitted preprocessing.json the model's inputs were built with"
    )
    imports.add_argument(
        "--calibration-data", required=True, help="rows with the target the model never trained on (.csv or .parquet)"
    )
    imports.add_argument(
        "--output", default=None, help="the graph output holding the logits [default: the only float one]"
    )
    imports.add_argument("--model-repository", default="var/models", help="repository root [default: var/models]")
    imports.set_defaults(func=models.import_model)
    publish = sub.add_parser(
        "publish",
        help="publish a trained version, pinned by content digest, to a folder, a bucket or an MLflow registry",
    )
    publish.add_argument(
        "--to",
        required=True,
        metavar="URI",
        help="a path, s3://bucket/prefix (AWS_* variables and files) or models:/, models:/name[@alias] "
        "(MLFLOW_TRACKING_URI)",
    )
    publish.add_argument("--model-repository", default="var/models", help="repository root [default: var/models]")
    publish.add_argument(
        "--model", action="append", help="model name (repeatable) [default: every model in the repository]"
    )
    publish.add_argument("--version", help="version to publish [default: the latest of each model]")
    publish.set_defaults(func=models.publish)

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
    migrate.add_argument(
        "--hand-back-outbox",
        action="store_true",
        help="before running a release older than ledger_0002 (a rollback, once its pods replaced this "
        "release's): give the decisions waiting in the ledger's outbox back to the per-row work list "
        "that release's relays claim",
    )
    migrate.set_defaults(func=models.migrate)

    serve = sub.add_parser("serve", help="run one of the two services")
    roles = serve.add_subparsers(dest="role", required=True)
    inference = roles.add_parser("inference", help="InferenceService: raw logits over gRPC")
    _add_settings_flags(inference, InferenceSettings, "INFERENCE_")
    inference.set_defaults(func=serving.serve_inference)
    prediction = roles.add_parser("prediction", help="PredictionService: decisions over gRPC")
    _add_settings_flags(prediction, PredictionSettings, "PREDICTION_")
    prediction.set_defaults(func=serving.serve_prediction)

    relay = sub.add_parser(
        "relay",
        help="deliver the decision ledger to the CRM database in a process of its own "
        "(beside PredictionService with PREDICTION_RELAY_IN_PROCESS=false)",
    )
    _add_settings_flags(relay, PredictionSettings, "PREDICTION_", only=serving.RELAY_SETTINGS)
    relay.set_defaults(func=serving.relay)

    demo = sub.add_parser("demo", help="train, start both services, score every holdout applicant, summarise, stop")
    demo.add_argument("--model-repository", default="var/models", help="repository root [default: var/models]")
    demo.add_argument("--workdir", default="var/demo", help="CRM database and service logs [default: var/demo]")
    demo.add_argument("--config-dir", default="config", help="schemas and policies [default: config]")
    demo.add_argument("--concurrency", type=int, default=32, help="Predict calls in flight [default: 32]")
    demo.set_defaults(func=operate.demo)

    health = sub.add_parser("health", help="grpc.health.v1 check; exit 0 only when SERVING")
    health.add_argument("--target", default="127.0.0.1:8001", help="host:port [default: 127.0.0.1:8001]")
    health.add_argument("--service", default="", help="service name; empty = overall")
    health.add_argument("--timeout-s", type=float, default=2.0, help="seconds to wait [default: 2]")
    health.set_defaults(func=calls.health)

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
    predict.set_defaults(func=calls.predict)

    attributes = sub.add_parser("attributes", help="each family's attributes: type, unit, range, accepted categories")
    attributes.add_argument("--config-dir", default="config", help="schemas [default: config]")
    attributes.add_argument(
        "--model-repository",
        default="var/models",
        help="trained models, whose vocabularies list the categories [default: var/models]",
    )
    attributes.add_argument("--markdown", action="store_true", help="print the README's Markdown table")
    attributes.set_defaults(func=calls.attributes)

    drift = sub.add_parser(
        "drift-report",
        help="drift of a running PredictionService's features and scores; "
        "exit status from the families with a verdict: 0 no drift, 2 drift in any; "
        f"{DRIFT_NO_VERDICT} no family with a verdict yet (no traffic or too few decisions); 1 unreadable",
    )
    drift.add_argument(
        "--metrics-url",
        default="http://127.0.0.1:9002/metrics",
        help="PredictionService Prometheus endpoint [default: http://127.0.0.1:9002/metrics]",
    )
    drift.add_argument("--json", action="store_true", help="print JSON instead of a table")
    drift.add_argument("--timeout-s", type=float, default=5.0, help="seconds to wait [default: 5]")
    drift.set_defaults(func=operate.drift_report)

    check = sub.add_parser(
        "check-model",
        help="where ONNX Runtime would run each node of a model on a target provider, before publishing it; "
        "exit 0 all on it, 1 some would fall back (op types listed), 2 provider not in this build",
    )
    check.add_argument("--provider", required=True, choices=["cuda", "cpu"], help="target execution provider")
    check.add_argument("--model-repository", default="var/models", help="repository root [default: var/models]")
    check.add_argument("--model", default=None, help="model name [default: every model in the repository]")
    check.add_argument("--version", default=None, help="model version [default: each model's latest]")
    check.add_argument(
        "--graph-optimization",
        default="all",
        choices=["disable", "basic", "extended", "all"],
        help="ONNX Runtime graph optimisation, as INFERENCE_GRAPH_OPTIMIZATION: placement is of the optimised graph "
        "[default: all]",
    )
    check.set_defaults(func=check_model.check_model)

    score.add_parser(sub)
    outcomes.add_parser(sub)
    decision.add_parser(sub)
    events.add_parser(sub)
    return parser


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _fail(what: str, exc: BaseException, code: int) -> int:
    """Prints ``mlpair: <what>: <reason>`` on stderr (the traceback too with ``--debug``); returns ``code``."""
    import traceback

    from mlpair.startup import StartupError

    reason = _one_line(exc) if isinstance(exc, StartupError) else f"{type(exc).__name__}: {_one_line(exc)}"
    hint = "" if _debug or code == 2 else " (mlpair --debug … for the traceback)"
    trace = "".join(traceback.format_exception(exc)) if _debug else ""
    # One write: a supervisor stops the other workers as soon as one refuses to start, and a worker
    # stopped halfway through a line-by-line traceback would leave it, not the reason, last.
    sys.stderr.write(f"{trace}mlpair: {what}: {reason}{hint}\n")
    sys.stderr.flush()
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
    except BrokenPipeError:  # the reader of the output went away (`| head`): not the command's failure
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 0
    except Exception as exc:  # noqa: BLE001  (one line, not a traceback: --debug shows it)
        return _fail(what, exc, 1)


if __name__ == "__main__":
    # `python -m mlpair.cli` runs this file as __main__; the commands import mlpair.cli (for _fail and
    # the --debug flag), so run main() from that one module rather than from a second copy of it
    import importlib

    sys.exit(importlib.import_module("mlpair.cli").main())
