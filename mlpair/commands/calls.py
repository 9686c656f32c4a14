"""``mlpair predict``, ``mlpair health`` and ``mlpair attributes``: ask a running service (or the
feature schemas) one thing and print the answer."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlpair.api.prediction.v1.prediction_service_pb2 import PredictResponse


def predict(args: argparse.Namespace) -> int:
    """``mlpair predict``: one decision from a running PredictionService (:class:`mlpair.client.PredictionClient`),
    printed as a few lines (:func:`render`).

    Returns:
        0, or 1 when the service refused the request or could not be reached (one line on stderr:
        target, status code, details).

    Raises:
        StartupError: a malformed ``--attr`` or an unreadable TLS file (exit 2 in :func:`mlpair.cli.main`).
    """
    import grpc

    from mlpair.client import PredictionClient
    from mlpair.rpc import channel_credentials
    from mlpair.startup import StartupError

    try:
        attributes = parse_attributes(args.attr or [])
        credentials = channel_credentials(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)
    except (ValueError, OSError) as exc:
        raise StartupError(str(exc)) from exc
    try:
        with PredictionClient(args.target, credentials=credentials, timeout_s=args.timeout_s) as client:
            reply = client.predict(
                args.family, args.entity_id, attributes, request_id=args.request_id or None, explain=args.explain
            )
    except grpc.RpcError as exc:
        hint = ""
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            hint = f" (is PredictionService up and ready there? `mlpair health --target {args.target}`)"
        print(f"mlpair predict: {args.target}: {exc.code().name}: {exc.details()}{hint}", file=sys.stderr)
        return 1
    print(render(reply))
    return 0


def parse_attributes(pairs: list[str]) -> dict[str, float | str | None]:
    """``["Income=1290", "Home=rent", "Debt="]`` → ``{"Income": 1290.0, "Home": "rent", "Debt": None}``.

    A value that reads as a finite number travels as a number, an empty one as null (missing),
    anything else as a string (the feature schema converts it: ``yes`` for a boolean, a category
    name, ``"42"`` for a number). ``mlpair attributes`` lists what each family accepts.

    Raises:
        ValueError: a pair has no ``=`` or an empty name, or a name is given twice.
    """
    out: dict[str, float | str | None] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--attr {pair!r}: expected NAME=VALUE (e.g. Income=1290)")
        if name.strip() in out:
            raise ValueError(f"--attr {name.strip()} is given twice: give each attribute once")
        out[name.strip()] = _value(text.strip())
    return out


def _value(text: str) -> float | str | None:
    if not text:
        return None
    try:
        number = float(text)
    except ValueError:
        return text
    return number if math.isfinite(number) else text


def render(reply: PredictResponse) -> str:
    """The decision as a few human-readable lines: decision, reasons, probability, versions, warnings."""
    # Fields a reply leaves unset are left out, not printed empty: no model version on a fallback
    # (no model answered), no calibration method on a replay (the proto's rules).
    model = [
        *([f"version {reply.model_version}"] if reply.model_version else ["none (fallback)"]),
        f"feature schema {reply.feature_schema_version}",
        f"policy {reply.policy_version}",
        *([f"calibration {reply.calibration_method}"] if reply.calibration_method else []),
    ]
    lines = [
        f"decision      {reply.decision_label}" + (" (fallback: no model answer)" if reply.fallback else ""),
        f"reasons       {', '.join(reply.reason_codes) or '-'}",
        f"probability   {reply.probability:.4f}" + (" (none: fallback)" if reply.fallback else ""),
        f"model         {', '.join(model)}",
        f"request id    {reply.request_id} (decision {reply.decision_id}"
        + (", replayed" if reply.replayed else "")
        + ")",
    ]
    lines += [f"explanation   {text}" for text in reply.top_reasons]
    lines += [f"warning       {w.code} {w.field}: {w.message}" for w in reply.warnings]
    if reply.stale:
        lines.append(f"degraded      {reply.degraded_reason} (served from the cache, {reply.cache_age_ms} ms old)")
    elif reply.degraded_reason:
        lines.append(f"degraded      {reply.degraded_reason}")
    return "\n".join(lines)


def health(args: argparse.Namespace) -> int:
    """``mlpair health``: one ``grpc.health.v1`` check (:func:`mlpair.client.check_health`); 0 only when
    the answer is SERVING, else 1 (the status, or the call's error code, printed)."""
    import grpc

    from mlpair.client import check_health

    try:
        status = check_health(args.target, args.service, timeout_s=args.timeout_s)
    except grpc.RpcError as exc:
        print(f"{args.target}: {exc.code().name}", file=sys.stderr)
        return 1
    print(f"{args.target}: {status}")
    return 0 if status == "SERVING" else 1


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
