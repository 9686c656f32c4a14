"""``grpc.health.v1`` of either service from Python: :func:`check_health`, :func:`wait_until_serving`;
see :mod:`mlpair.client`."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlpair.client.channels import open_channel


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
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


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
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and alive():
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return True
            except grpc.RpcError:
                pass
            time.sleep(poll_s)
    return False
