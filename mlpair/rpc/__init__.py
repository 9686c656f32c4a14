"""gRPC plumbing shared by both servers and PredictionService's client, one concern per module.

* :mod:`~mlpair.rpc.status` — rich error statuses: :func:`to_status`, :func:`error_info`,
  :class:`MalformedRequest`.
* :mod:`~mlpair.rpc.servicers` — registration and the guard, the one place exceptions become
  statuses: :func:`add_servicer` (tolerant deserialization), :func:`guard_servicer`, :func:`rpc_methods`.
* :mod:`~mlpair.rpc.tls` — :func:`server_credentials`, :func:`channel_credentials`.
* :mod:`~mlpair.rpc.channels` — :func:`open_channel`, :func:`message_size_options`,
  :func:`client_keepalive_options`.
* :mod:`~mlpair.rpc.health` — ``grpc.health.v1`` with liveness beside readiness:
  :class:`Health` (the one health helper), :class:`LifecycleHealthServicer`, :data:`LIVENESS`;
  :func:`wait_until_serving` is :func:`mlpair.client.wait_until_serving`, re-exported here.
* :mod:`~mlpair.rpc.reads` — :func:`guard_request_reads`: grpc.aio's request read made safe for
  cancelled and expired calls (a native leak in grpcio, grpc/grpc#43360).
* :mod:`~mlpair.rpc.drain` — the one way a server stops: :func:`drain`, :class:`DrainGate`,
  :class:`Draining`, :func:`wait_for_termination_signal`.
* :mod:`~mlpair.rpc.server` — the one server factory, :func:`build_server` with :class:`Service`,
  and what it reads: :class:`ConnectionSettings`, :func:`server_options`,
  :func:`port_sharing_options`, :func:`bind_port`, :func:`enable_reflection`.

Layers, lowest first: ``status``, ``tls``, ``channels``, ``reads`` and ``drain`` import nothing of this
package; ``health`` imports ``drain``; ``servicers`` imports ``drain`` and ``status``; ``server``
imports ``channels``, ``health``, ``reads``, ``servicers`` and ``tls``. Nothing here imports the services or
:mod:`mlpair.observability` (which imports this package: tracing reaches :func:`build_server` as
its ``observe`` hook); the package imports :mod:`mlpair.client` for :func:`wait_until_serving`
alone, and the client imports nothing of the project but the generated :mod:`mlpair.api`. The
names above are importable from here as well as from their module.
"""

from mlpair.client.health import wait_until_serving  # defined with the public client; importable here as before
from mlpair.rpc.channels import client_keepalive_options, message_size_options, open_channel
from mlpair.rpc.drain import QUIET_S, DrainGate, Draining, drain, wait_for_termination_signal
from mlpair.rpc.health import LIVENESS, NOT_SERVING, SERVING, Health, LifecycleHealthServicer
from mlpair.rpc.reads import guard_request_reads
from mlpair.rpc.server import (
    ConnectionSettings,
    ServerSettings,
    Service,
    bind_port,
    build_server,
    enable_reflection,
    port_sharing_options,
    server_options,
)
from mlpair.rpc.servicers import add_servicer, guard_servicer, rpc_methods
from mlpair.rpc.status import MalformedRequest, error_info, to_status
from mlpair.rpc.tls import channel_credentials, server_credentials

__all__ = [
    "LIVENESS",
    "NOT_SERVING",
    "QUIET_S",
    "SERVING",
    "ConnectionSettings",
    "DrainGate",
    "Draining",
    "Health",
    "LifecycleHealthServicer",
    "MalformedRequest",
    "ServerSettings",
    "Service",
    "add_servicer",
    "bind_port",
    "build_server",
    "channel_credentials",
    "client_keepalive_options",
    "drain",
    "enable_reflection",
    "error_info",
    "guard_request_reads",
    "guard_servicer",
    "message_size_options",
    "open_channel",
    "port_sharing_options",
    "rpc_methods",
    "server_credentials",
    "server_options",
    "to_status",
    "wait_for_termination_signal",
    "wait_until_serving",
]
