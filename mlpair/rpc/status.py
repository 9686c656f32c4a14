"""Rich gRPC error statuses: one ``google.rpc.Status`` with one ``ErrorInfo`` (AIP-193).

Servers build them with :func:`to_status` (only :mod:`mlpair.rpc.servicers`' guard does, plus a
stream's per-message errors); clients read the detail back with :func:`error_info`.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from mlpair.errors import ServiceError


def to_status(code: str, message: str, reason: str, domain: str, metadata: dict[str, str]) -> grpc.Status:
    """Builds the rich status for an error: code, message and one ErrorInfo detail.

    Args:
        code: a ``google.rpc.Code`` name, e.g. ``"INVALID_ARGUMENT"``.
        reason: the stable machine-readable reason, e.g. ``"MALFORMED_REQUEST"``.
        domain: the service's error domain (each service's ``errors.DOMAIN``).

    Raises:
        AttributeError: ``code`` is not a ``google.rpc.Code`` name.
    """
    info = error_details_pb2.ErrorInfo(reason=reason, domain=domain, metadata=metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=getattr(code_pb2, code), message=message, details=[detail])
    return rpc_status.to_status(status)


def error_info(error: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo detail of a failed call, if the server sent one."""
    status = rpc_status.from_call(error)
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return None


class MalformedRequest(ServiceError):
    """The request's bytes are not a valid message of the method's type."""

    code = "INVALID_ARGUMENT"
    reason = "MALFORMED_REQUEST"
