"""The root of both services' error hierarchies (no grpc import: cores stay transport-neutral).

Each error class carries the gRPC status code name it maps to and a stable, machine-readable
``reason`` (AIP-193 ``ErrorInfo.reason``). Its message is written for the client and must
never contain internal exception text; :mod:`mlpair.rpc` turns these into ``google.rpc.Status``.
A message names attributes, never their values; what it repeats of a caller's input (a request
id, a model name, a field's path) loses every documented identifier form, as a log line does
(:func:`mlpair.observability.redaction.identifiers`), so an error's details carry no personal data
into a client's logs, a proxy's access log or this service's own.
"""

from __future__ import annotations

from collections.abc import Mapping

from mlpair.observability.redaction import identifiers


class ServiceError(Exception):
    """An error a client may see: message, status code name, reason and string metadata."""

    code: str = "INTERNAL"
    reason: str = "INTERNAL"

    def __init__(self, message: str, *, metadata: Mapping[str, str] | None = None) -> None:
        """``message`` and each ``metadata`` value (strings) are kept redacted."""
        message = identifiers(message)
        super().__init__(message)
        self.message = message
        self.metadata = {k: identifiers(v) if isinstance(v, str) else v for k, v in (metadata or {}).items()}
