"""A per-item ``google.rpc.Status`` (a BatchPredict item's, an outcome's) read as the client's error fields,
and a reply's per-item results read as values or those errors."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import grpc
from google.rpc import error_details_pb2, status_pb2


def status_fields(status: status_pb2.Status) -> tuple[grpc.StatusCode, str, str, dict[str, str]]:
    """``(code, message, reason, metadata)`` of a per-item status: its gRPC code (``UNKNOWN`` for a
    number gRPC does not name), message, and its ErrorInfo detail's reason and metadata (empty
    when it carries none)."""
    info = error_details_pb2.ErrorInfo()
    found = any(d.Unpack(info) for d in status.details)
    code = next((c for c in grpc.StatusCode if c.value[0] == status.code), grpc.StatusCode.UNKNOWN)
    return code, status.message, info.reason, dict(info.metadata) if found else {}


E = TypeVar("E")


def item_results(
    results: Iterable[Any], oneof: str, field: str, error: Callable[[grpc.StatusCode, str, str, dict[str, str]], E]
) -> list[Any | E]:
    """Per item of a reply's ``results``, in order: its ``field`` where its ``oneof`` holds that field,
    else ``error`` made from its ``error`` status (:func:`status_fields`)."""
    return [getattr(r, field) if r.WhichOneof(oneof) == field else error(*status_fields(r.error)) for r in results]
