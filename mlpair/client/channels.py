"""The one way this client opens a blocking channel: plaintext, or TLS with the given credentials."""

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
