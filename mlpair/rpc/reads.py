"""A guard on how ``grpc.aio`` servers read a unary request, against a native leak in grpcio.

grpcio's asyncio server reads each request with a one-operation Core batch
(``cygrpc._receive_message`` → ``execute_batch``) whose ``grpc_op`` array, 80 bytes
``gpr_malloc``'d, is freed only when the awaiting coroutine resumes after a successful batch.
Two ordinary endings skip that (grpc/grpc#43360, open upstream; present in grpcio 1.85.3):

* the call's deadline passed before the server got to read it: Core has cancelled the call,
  the batch fails, and the array stays (one per call that ends DEADLINE_EXCEEDED this way);
* the client cancelled while the read was in flight: grpc.aio cancels the handler's task, the
  batch's tag is dropped with its array (one per call the client cancels this way).

A server under load meets both all the time, and its resident memory grows with every such call,
without bound (docs/reliability.md has the heap profile and the soak). :func:`guard_request_reads` replaces grpc.aio's read with one that
does not start the batch once the call's deadline has passed (the call is over: the handler
returns at once, as grpc.aio does for a call cancelled before its message, and Core answers
DEADLINE_EXCEEDED) and that shields the batch from the handler's cancellation, so it completes
and is freed even when nobody waits for its message any more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

_installed: Callable[..., Awaitable[bytes | None]] | None = None


def _consume(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # read by nobody once the handler has gone: must not be logged as lost


def guard_request_reads(enabled: bool = True) -> bool:
    """Installs the guarded read in grpcio's asyncio server, process-wide (idempotent); with
    ``enabled`` False, puts grpcio's own read back.

    Returns:
        True when the guarded read is in place; False when it is not: not ``enabled``, or this
        grpcio has no such read to guard (its internals changed; a warning says so).
    """
    global _installed
    from grpc._cython import cygrpc

    if _installed is not None and cygrpc._receive_message is _installed:
        if enabled:
            return True
        cygrpc._receive_message = _installed.__wrapped__  # type: ignore[attr-defined]
        _installed = None
        return False
    if not enabled:
        return False
    original = getattr(cygrpc, "_receive_message", None)
    context_type = getattr(cygrpc, "_ServicerContext", None)
    server_call = getattr(cygrpc, "RPCState", None)
    if original is None or context_type is None or server_call is None:
        logger.warning(
            "grpcio's asyncio server has no _receive_message to guard: cancelled and expired "
            "calls may leak native memory (grpc/grpc#43360)"
        )
        return False

    async def receive_message(rpc_state: object, loop: asyncio.AbstractEventLoop) -> bytes | None:
        if type(rpc_state) is not server_call:  # a client's streaming call reads through here too: as it was
            return await original(rpc_state, loop)
        # time_remaining(): seconds to the call's deadline, 0 once it has passed, None without one
        if context_type(rpc_state, None, None, loop).time_remaining() == 0:
            return None  # Core has ended the call (or is about to): a read would fail and leak its batch
        read = loop.create_task(original(rpc_state, loop))
        read.add_done_callback(_consume)
        return await asyncio.shield(read)  # a cancelled handler leaves the read to finish and free its batch

    receive_message.__wrapped__ = original  # type: ignore[attr-defined]
    cygrpc._receive_message = receive_message
    _installed = receive_message
    return True
