"""Rich gRPC error statuses: one ``google.rpc.Status`` with one ``ErrorInfo`` (AIP-193).

Servers build them with :func:`to_status` (only :mod:`mlpair.rpc.servicers`' guard does, plus a
stream's per-message errors); clients read the detail back with :func:`error_info`.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from mlpair.errors import ServiceError


def to_status(
    code: str, message: str, reason: str, domain: str, metadata: dict[str, str], retry_after_s: float | None = None
) -> grpc.Status:
    """Builds the rich status for an error: code, message and one ErrorInfo detail, and a
    ``RetryInfo`` (``retry_delay``) when ``retry_after_s`` (seconds) is given.

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
    details = [detail]
    if retry_after_s is not None:
        retry = any_pb2.Any()
        retry.Pack(
            error_details_pb2.RetryInfo(
                retry_delay=duration_pb2.Duration(seconds=int(retry_after_s), nanos=int((retry_after_s % 1) * 1e9))
            )
        )
        details.append(retry)
    status = status_pb2.Status(code=getattr(code_pb2, code), message=message, details=details)
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


def retry_delay_s(error: grpc.RpcError) -> float | None:
    """The ``RetryInfo`` delay of a failed call in seconds, if the server sent one."""
    status = rpc_status.from_call(error)
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return None


class MalformedRequest(ServiceError):
    """The request's bytes are not a valid message of the method's type."""

    code = "INVALID_ARGUMENT"
    reason = "MALFORMED_REQUEST"
