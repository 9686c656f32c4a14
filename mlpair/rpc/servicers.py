"""Servicer registration and the guard: the one place exceptions become gRPC statuses.

:func:`guard_servicer` maps :class:`~mlpair.errors.ServiceError` to a ``google.rpc.Status``
with one ``ErrorInfo(reason, domain, metadata)`` (grpcio-status); anything else becomes
INTERNAL with a generic message and is logged with its traceback, so internal exception text
never reaches a client and servicers need no try/except. :func:`add_servicer` registers a
servicer with a tolerant deserializer, so a malformed request reaches that guard too.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from mlpair.errors import ServiceError
from mlpair.rpc.drain import DrainGate
from mlpair.rpc.status import MalformedRequest, to_status
from mlpair.wire import Refused, check_metadata, parse_strictly

logger = logging.getLogger(__name__)

S = TypeVar("S")


class _Undecodable:
    """Stands in for a request whose bytes did not parse (see :func:`add_servicer`)."""

    __slots__ = ()


_UNDECODABLE = _Undecodable()


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], object]:
    strict = parse_strictly(deserialize)

    def parse(data: bytes) -> object:
        try:
            return strict(data)
        except DecodeError:
            return _UNDECODABLE

    return parse


class _Captured:
    """Collects what a generated ``add_<Service>Servicer_to_server`` function registers."""

    service: str
    handlers: dict[str, Any]

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.service, self.handlers = service, handlers


def add_servicer(add_to_server: Callable[[Any, Any], None], servicer: object, server: grpc.aio.Server) -> None:
    """Registers ``servicer`` as the generated ``add_to_server`` would, except that a request
    whose bytes are not a valid message reaches the guarded handler (:func:`guard_servicer`)
    as a marker it refuses with INVALID_ARGUMENT (MALFORMED_REQUEST), and one carrying fields
    the contract does not define as a :class:`~mlpair.wire.Refused` (UNKNOWN_FIELD). Left to
    itself, gRPC answers the first UNKNOWN, with the parser's exception text as the message,
    and the handler would silently ignore the second's fields.
    """
    captured = _Captured()
    add_to_server(servicer, captured)
    handlers = {}
    for name, handler in captured.handlers.items():
        if handler.request_deserializer:
            handler = handler._replace(request_deserializer=_tolerant(handler.request_deserializer))
        handlers[name] = handler
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(captured.service, handlers),))
    server.add_registered_method_handlers(captured.service, handlers)


RefusalHook = Callable[[str, object, str], None]
"""Told of a call refused before its handler ran: (``Servicer.Method``, the request — a message, or
the marker of one that did not parse —, the status code name)."""


def _guarded(
    inner: Callable[..., Awaitable[Any]],
    method: str,
    domain: str,
    gate: DrainGate | None = None,
    refused: RefusalHook | None = None,
) -> Callable[..., Awaitable[Any]]:
    """``inner`` with exceptions mapped to rich statuses (the one place that does the mapping),
    counted by ``gate``; once the drain closes it, held and then refused UNAVAILABLE (DRAINING).
    ``refused`` hears of every call refused before ``inner`` ran (the handler counts its own).
    A call whose deadline has passed by the time it is answered is sent nothing: its caller has
    its DEADLINE_EXCEEDED already, and grpcio would leak the batch that fails to send it."""

    async def guarded(request: object, context: grpc.aio.ServicerContext) -> Any:
        admitted = entered = False
        try:
            if gate is not None:
                if not gate.enter():
                    await gate.refuse()  # held until the server has begun to stop, then UNAVAILABLE
                admitted = True
            if request is _UNDECODABLE:
                raise MalformedRequest(f"the request is not a valid {method.rsplit('.', 1)[-1]} request message")
            if isinstance(request, Refused):
                raise request.error
            check_metadata(context.invocation_metadata())
            entered = True
            response = await inner(request, context)
            if context.time_remaining() != 0:  # seconds left, or None: no deadline
                return response
            status = None  # answered after its deadline
        except ServiceError as exc:
            if not entered and refused is not None:
                refused(method, request, exc.code)
            status = to_status(
                exc.code, exc.message, exc.reason, domain, exc.metadata, getattr(exc, "retry_after_s", None)
            )
        except grpc.aio.AbortError:
            raise  # the handler already chose its status
        except Exception:
            logger.exception("unexpected error in %s", method)
            status = to_status("INTERNAL", "internal error", "INTERNAL", domain, {})
        finally:
            if admitted and gate is not None:
                gate.leave()
        if status is None or context.time_remaining() == 0:
            # The deadline has passed: Core ends the call DEADLINE_EXCEEDED, and a status or response
            # sent now would fail in Core, leaking its batch in grpcio (grpc/grpc#43360, see
            # mlpair.rpc.reads). grpc.aio ends a handler that raises CancelledError sending nothing.
            raise asyncio.CancelledError
        await context.abort(status.code, status.details, status.trailing_metadata)

    return guarded


def rpc_methods(servicer: object) -> list[str]:
    """Names of a servicer's RPC methods: its CamelCase coroutine methods."""
    return [
        name
        for name in dir(type(servicer))
        if name[:1].isupper() and inspect.iscoroutinefunction(getattr(type(servicer), name))
    ]


def guard_servicer(servicer: S, domain: str, gate: DrainGate | None = None, refused: RefusalHook | None = None) -> S:
    """Maps exceptions escaping every RPC method of a servicer instance to rich gRPC statuses
    (:func:`_guarded`), by wrapping the methods in place; with a ``gate``, its calls are counted,
    and once the drain closes it they are held, then refused UNAVAILABLE (DRAINING); ``refused``
    hears of each call refused before its method ran (malformed message, unknown fields, bad
    metadata, the drain), so the service can count it as it counts the calls its methods refuse.

    Not an interceptor: grpc.aio runs interceptors in Python on every call, on top of its own
    per-call work (docs/decisions/0002-tracing-without-interceptors.md). Call before registering
    the servicer.
    """
    for name in rpc_methods(servicer):
        method = f"{type(servicer).__name__}.{name}"
        setattr(servicer, name, _guarded(getattr(servicer, name), method, domain, gate, refused))
    return servicer
