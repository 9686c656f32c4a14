"""The one way this client opens a channel, blocking or ``grpc.aio``: plaintext, or TLS with the given credentials."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

DEFAULT_TIMEOUT_S = 10.0  # deadline of a call that names none, in seconds


def open_channel(
    target: str, credentials: grpc.ChannelCredentials | None, options: Sequence[tuple[str, int]]
) -> grpc.Channel:
    """A channel to ``target`` (``host:port``): TLS with ``credentials``, else plaintext; ``options``
    are gRPC channel options. Close it (or use it as a context manager)."""
    if credentials is not None:
        return grpc.secure_channel(target, credentials, options=list(options))
    return grpc.insecure_channel(target, options=list(options))


def open_aio_channel(
    target: str, credentials: grpc.ChannelCredentials | None, options: Sequence[tuple[str, int]]
) -> grpc.aio.Channel:
    """:func:`open_channel` for asyncio (``grpc.aio``); close it with ``await channel.close()``."""
    if credentials is not None:
        return grpc.aio.secure_channel(target, credentials, options=list(options))
    return grpc.aio.insecure_channel(target, options=list(options))
