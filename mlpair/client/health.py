"""``grpc.health.v1`` of either service from Python: :func:`check_health`, :func:`wait_until_serving`;
see :mod:`mlpair.client`.

The protocol's two messages are built here, in a descriptor pool of this module's own, rather than
imported from grpcio-health-checking: the client-only distribution (``clients/python``) then needs no
such dependency, whose releases' generated code wants a newer protobuf than their metadata declares
(1.71.2 declares protobuf 5.26.1, and its modules refuse anything older than 5.29.0), and an
application's own ``grpc.health.v1`` modules never meet these in protobuf's default pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import cache
from typing import Any

import grpc

from mlpair.client.channels import open_channel

CHECK_METHOD = "/grpc.health.v1.Health/Check"
SERVING_STATUSES = ("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")  # HealthCheckResponse.ServingStatus


@cache
def _messages() -> tuple[Any, Any]:
    """``grpc.health.v1.HealthCheckRequest`` and ``HealthCheckResponse`` (grpc/health/v1/health.proto,
    fields by number as published) as message classes of a private descriptor pool."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="mlpair/client/health.proto", package="grpc.health.v1")
    proto.syntax = "proto3"
    request = proto.message_type.add(name="HealthCheckRequest")
    request.field.add(name="service", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
    response = proto.message_type.add(name="HealthCheckResponse")
    statuses = response.enum_type.add(name="ServingStatus")
    for number, name in enumerate(SERVING_STATUSES):
        statuses.value.add(name=name, number=number)
    response.field.add(
        name="status",
        number=1,
        type=field.TYPE_ENUM,
        label=field.LABEL_OPTIONAL,
        type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus",
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return tuple(
        message_factory.GetMessageClass(pool.FindMessageTypeByName(f"grpc.health.v1.{name}"))
        for name in ("HealthCheckRequest", "HealthCheckResponse")
    )


def _check(channel: grpc.Channel, service: str, timeout_s: float) -> str:
    """One Check call on ``channel``: the status name (an unknown number as ``str(number)``)."""
    request, response = _messages()
    call = channel.unary_unary(
        CHECK_METHOD, request_serializer=request.SerializeToString, response_deserializer=response.FromString
    )
    status = call(request(service=service), timeout=timeout_s).status
    return SERVING_STATUSES[status] if 0 <= status < len(SERVING_STATUSES) else str(status)


def check_health(
    target: str, service: str = "", *, timeout_s: float = 2.0, credentials: grpc.ChannelCredentials | None = None
) -> str:
    """One ``grpc.health.v1`` check of either service (``service``: empty = the server overall).

    Returns:
        The status name: ``"SERVING"``, ``"NOT_SERVING"`` (loading, warming up or draining) or
        ``"UNKNOWN"``.

    Raises:
        grpc.RpcError: UNAVAILABLE (nothing answers at ``target``), DEADLINE_EXCEEDED (no answer in
            ``timeout_s`` seconds), NOT_FOUND (no such ``service``).
    """
    with open_channel(target, credentials, ()) as channel:
        return _check(channel, service, timeout_s)


def wait_until_serving(
    target: str, timeout_s: float, alive: Callable[[], bool] = lambda: True, poll_s: float = 0.05
) -> bool:
    """Polls ``grpc.health.v1`` (overall, plaintext) at ``target`` until it reports SERVING.

    For scripts and tests that start a service as a process: ``alive()`` is asked before each
    poll (e.g. ``lambda: process.poll() is None``), so a process that exits is noticed at once.

    Returns:
        True when SERVING; False when ``timeout_s`` seconds passed or ``alive()`` turned false.
    """
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        while time.monotonic() < deadline and alive():
            try:
                if _check(channel, "", 1.0) == "SERVING":
                    return True
            except grpc.RpcError:
                pass
            time.sleep(poll_s)
    return False
