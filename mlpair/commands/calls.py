"""``mlpair predict``, ``mlpair health`` and ``mlpair attributes``: ask a running service (or the
feature schemas) one thing and print the answer."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def predict(args: argparse.Namespace) -> int:
    """``mlpair predict``: one decision from a running PredictionService, printed as a few lines.

    Returns:
        0, or 1 when the service refused the request or could not be reached (one line on stderr:
        target, status code, details).

    Raises:
        StartupError: a malformed ``--attr`` or an unreadable TLS file (exit 2 in :func:`mlpair.cli.main`).
    """
    import grpc

    from mlpair.client import parse_attributes, render
    from mlpair.client import predict as ask
    from mlpair.rpc import channel_credentials
    from mlpair.startup import StartupError

    try:
        attributes = parse_attributes(args.attr or [])
        credentials = channel_credentials(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)
    except (ValueError, OSError) as exc:
        raise StartupError(str(exc)) from exc
    try:
        reply = ask(
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


def health(args: argparse.Namespace) -> int:
    """``mlpair health``: one ``grpc.health.v1`` check; 0 only when the answer is SERVING, else 1."""
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


def attributes(args: argparse.Namespace) -> int:
    """``mlpair attributes``: each family's attributes as a table (or the README's Markdown); 0."""
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
