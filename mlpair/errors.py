"""The root of both services' error hierarchies (no grpc import: cores stay transport-neutral).

Each error class carries the gRPC status code name it maps to and a stable, machine-readable
``reason`` (AIP-193 ``ErrorInfo.reason``). Its message is written for the client and must
never contain internal exception text; :mod:`mlpair.rpc` turns these into ``google.rpc.Status``.
"""

from __future__ import annotations

from collections.abc import Mapping


class ServiceError(Exception):
    """An error a client may see: message, status code name, reason and string metadata."""

    code: str = "INTERNAL"
    reason: str = "INTERNAL"

    def __init__(self, message: str, *, metadata: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.metadata = dict(metadata or {})
