"""The one server factory both services are built by, and what it reads from their settings.

:func:`build_server` makes a ``grpc.aio`` server the same way for InferenceService and
PredictionService: message size limits, keepalive and connection-age policy, port sharing;
each servicer guarded (errors → statuses, calls through the drain gate) and registered with
a tolerant deserializer; the health service; server reflection; TLS or plaintext; the port bound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection
from pydantic_settings import BaseSettings, SettingsConfigDict

from mlpair.rpc.channels import message_size_options
from mlpair.rpc.health import Health
from mlpair.rpc.reads import guard_request_reads
from mlpair.rpc.servicers import add_servicer, guard_servicer
from mlpair.rpc.tls import server_credentials
from mlpair.startup import StartupError
from mlpair.workers import check_port_free


class ConnectionSettings(BaseSettings):
    """Connection settings both services' settings classes share (each adds its own env prefix)."""

    model_config = SettingsConfigDict(extra="ignore", use_attribute_docstrings=True)

    keepalive_min_ping_interval_ms: int = 1000
    """Shortest interval between a client's keepalive pings that the server accepts, in ms; pinging
    more often is a strike, and two strikes close the connection (GOAWAY too_many_pings)."""
    keepalive_permit_without_calls: bool = True
    """Accept keepalive pings on a connection with no call in flight (clients keeping idle connections warm)."""
    max_connection_age_ms: int = 300_000
    """Connections are closed gracefully (GOAWAY) after about this long, so clients reconnect and spread
    over replicas added since; 0 = never. Long ModelStreamInfer streams end with their connection."""
    max_connection_age_grace_ms: int = 30_000
    """Milliseconds calls in flight on an aged connection get to finish before it is closed."""
    reflection: bool = True
    """gRPC server reflection (grpcurl, grpc_cli, Postman list and call the services without .proto files)."""
    guard_request_reads: bool = True
    """Read requests through :func:`mlpair.rpc.reads.guard_request_reads`, so that calls cancelled or expired
    before their request is read leave no native memory behind in grpcio (grpc/grpc#43360); off runs grpcio's
    own read (process-wide: the last server built decides)."""


class ServerSettings(Protocol):
    """What :func:`build_server` reads: a service's settings (a :class:`ConnectionSettings` with
    the fields below, each documented in the service's own settings class)."""

    host: str
    port: int
    max_message_bytes: int
    tls_cert_file: Path | None
    tls_key_file: Path | None
    tls_client_ca_file: Path | None
    keepalive_min_ping_interval_ms: int
    keepalive_permit_without_calls: bool
    max_connection_age_ms: int
    max_connection_age_grace_ms: int
    reflection: bool
    guard_request_reads: bool


@dataclass(frozen=True)
class Service:
    """One gRPC service to serve.

    Attributes:
        name: its full name, e.g. ``mlpair.inference.v1.InferenceService`` (health, reflection).
        servicer: the servicer instance (guarded by :func:`build_server`).
        add_to_server: the generated ``add_<Service>Servicer_to_server`` function.
        refused: told of each call refused before its method ran
            (:func:`~mlpair.rpc.servicers.guard_servicer`), or None.
    """

    name: str
    servicer: object
    add_to_server: Callable[[Any, Any], None]
    refused: Callable[[str, object, str], None] | None = None


def server_options(settings: ServerSettings) -> list[tuple[str, int]]:
    """gRPC server options for the keepalive and connection-age policy of ``settings``.

    gRPC's server defaults refuse what many clients do: a ping more often than every 5 minutes
    without a call in flight is a strike, and after 2 strikes the server closes the connection
    with GOAWAY ``too_many_pings`` (a client pinging every second was cut off after 3 s).
    """
    options = [
        ("grpc.http2.min_ping_interval_without_data_ms", settings.keepalive_min_ping_interval_ms),
        ("grpc.keepalive_permit_without_calls", int(settings.keepalive_permit_without_calls)),
    ]
    if settings.max_connection_age_ms > 0:
        options += [
            ("grpc.max_connection_age_ms", settings.max_connection_age_ms),
            ("grpc.max_connection_age_grace_ms", settings.max_connection_age_grace_ms),
        ]
    return options


def port_sharing_options(shared: bool) -> list[tuple[str, int]]:
    """Server options for the port: ``SO_REUSEPORT`` only for the workers of one supervisor
    (:mod:`mlpair.workers`, which owns the port first); a single process binds it exclusively, so a
    second server on its port fails to start instead of silently taking part of the traffic
    (gRPC's default is ``grpc.so_reuseport = 1``)."""
    return [("grpc.so_reuseport", 1 if shared else 0)]


def bind_port(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Binds ``address`` (``host:port``) with TLS when ``credentials`` are given, else plaintext;
    returns the port.

    Raises:
        StartupError: the port is in use or the address cannot be bound (one line naming the port).
    """
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # gRPC says only "Failed to bind to address ...": find out why
        host, _, port = address.rpartition(":")
        check_port_free(host, int(port))  # raises, naming the port, when it is in use
        raise StartupError(f"cannot bind port {port} on {host}; check the host and port settings") from exc


def enable_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """gRPC server reflection (grpcio-reflection) listing ``service_names``, health and reflection
    itself, so grpcurl and grpc_cli can call the server without the .proto files."""
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)


def build_server(
    settings: ServerSettings,
    services: Sequence[Service],
    health: Health,
    *,
    domain: str,
    shared_port: bool = False,
    observe: Callable[[object, str], object] | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Builds a server for ``services`` with ``health`` and binds its port (``settings.port`` 0 = a
    free one): with SO_REUSEPORT when ``shared_port`` (one of a supervisor's workers), else exclusively.

    No interceptors (grpc.aio runs each in Python on every call): every servicer is guarded
    (:func:`~mlpair.rpc.servicers.guard_servicer`, through ``health.gate``), then handed to
    ``observe`` with its service name (spans and log context wrap the guarded methods, so they see
    the status the guard chose), then registered (:func:`~mlpair.rpc.servicers.add_servicer`).
    Requests are read through :func:`~mlpair.rpc.reads.guard_request_reads` (unless
    ``settings.guard_request_reads`` is off), so that cancelled and expired calls leave no memory
    behind in grpcio.

    Args:
        domain: the service's error domain (``ErrorInfo.domain`` of every status).

    Returns:
        The server, not started, and its bound port.

    Raises:
        StartupError: the port is in use or cannot be bound.
        ValueError, OSError: the TLS settings are inconsistent or a file cannot be read.
    """
    guard_request_reads(settings.guard_request_reads)
    server = grpc.aio.server(
        options=[
            *message_size_options(settings.max_message_bytes),
            *server_options(settings),
            *port_sharing_options(shared_port),
        ]
    )
    for service in services:
        servicer = guard_servicer(service.servicer, domain, health.gate, service.refused)
        if observe is not None:
            observe(servicer, service.name)
        add_servicer(service.add_to_server, servicer, server)
    health.add_to(server)
    if settings.reflection:
        enable_reflection(server, [service.name for service in services])
    tls = server_credentials(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)
    return server, bind_port(server, f"{settings.host}:{settings.port}", tls)
