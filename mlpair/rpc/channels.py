"""Client channels and the options both ends share: message size limits and keepalive."""

from __future__ import annotations

from collections.abc import Sequence

import grpc


def message_size_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Channel/server options that cap both directions at ``max_message_bytes`` (bytes); a larger
    message is refused by gRPC with RESOURCE_EXHAUSTED before any parsing."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def client_keepalive_options(keepalive_ms: int, timeout_ms: int) -> list[tuple[str, int]]:
    """Channel options of a client that pings every ``keepalive_ms`` (calls in flight or not) and
    drops the connection when a ping is not answered within ``timeout_ms``; 0 = no pings.

    The server must accept pings that often (its ``keepalive_min_ping_interval_ms``, at most
    ``keepalive_ms``), or it closes the connection after two early pings.
    """
    if keepalive_ms <= 0:
        return []
    return [
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def open_channel(
    target: str,
    options: Sequence[tuple[str, int | str]],
    credentials: grpc.ChannelCredentials | None = None,
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
) -> grpc.aio.Channel:
    """An asyncio channel to ``target`` (``host:port``): TLS when ``credentials`` are given, else plaintext."""
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)
