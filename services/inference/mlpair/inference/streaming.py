"""Answering a bidirectional stream of requests (OIP ``ModelStreamInfer``), one response each.

Transport-neutral: it reads an async iterator of requests and yields responses; the servicer
plugs it into gRPC. Each request runs through the same path as a unary call (the servicer's
``answer``), concurrently with the stream's other requests, so one stream's requests share
batches with each other and with every other caller.

* **Order.** Responses go out in the order the requests arrived (Triton does the same for
  non-decoupled models), so a client may match them by position as well as by id.
* **Errors.** A request that fails gets an error response built by ``on_error`` and the stream
  goes on; an unexpected exception is logged with its traceback and answered INTERNAL with a
  generic message (no internal text reaches the client).
* **Backpressure.** At most ``max_in_flight`` requests are read but not yet answered. At the
  limit the stream is not read until a response has been sent: gRPC's HTTP/2 flow control then
  holds the client, and the server's memory per stream stays bounded. A client that does not
  read its responses stops the server reading its requests the same way.
* **Cancellation.** When the client cancels the stream (or it fails), every request of the
  stream still running is cancelled; rows still queued in a batcher are removed and never
  computed (counted as ``inference_queue_dropped_total{reason="cancelled"}``).
* **Drain.** Once ``drain`` is set, the stream reads nothing more, answers what it holds, and
  ends with :class:`~mlpair.inference.errors.Draining` (UNAVAILABLE): the client reconnects to
  another replica and resends what got no response.
* **Stream errors** end the call through ``abort`` with their status; anything unexpected is
  logged and ends it INTERNAL with a generic message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar

from mlpair.errors import ServiceError
from mlpair.inference.errors import Draining

logger = logging.getLogger(__name__)

Request = TypeVar("Request")
Response = TypeVar("Response")

_END = object()  # the client closed its side: answer what is pending, then end
_DRAIN = object()  # the server is draining: answer what is pending, then end UNAVAILABLE


class AnswerStream(Generic[Request, Response]):
    """The responses to one stream of requests (module docstring).

    Args:
        requests: the stream's requests, as gRPC delivers them.
        answer: runs one request to its response; raises ServiceError (or anything) on failure.
        on_error: ``(request, code, reason, message)`` → the error response for a failed request.
        max_in_flight: requests read but not yet answered, at most (at least 1).
        drain: set when the server begins draining.
        abort: ends the call with a ServiceError's status (never returns normally).
    """

    def __init__(
        self,
        requests: AsyncIterable[Request],
        answer: Callable[[Request], Awaitable[Response]],
        on_error: Callable[[object, str, str, str], Response],
        *,
        max_in_flight: int,
        drain: asyncio.Event,
        abort: Callable[[ServiceError], Awaitable[None]],
    ) -> None:
        self._requests = requests
        self._answer = answer
        self._on_error = on_error
        self._slots = asyncio.Semaphore(max_in_flight)
        self._pending: asyncio.Queue = asyncio.Queue()  # answer tasks in arrival order, then _END/_DRAIN
        self._drain = drain
        self._abort = abort

    async def responses(self) -> AsyncIterator[Response]:
        """Yields one response per request, in arrival order, until the client closes its side;
        ends the call through ``abort`` when the server drains (the responses before it all sent)."""
        loop = asyncio.get_running_loop()
        reader = watcher = current = None
        try:
            if self._drain.is_set():
                raise Draining("the server is shutting down; open the stream on another replica")
            reader = loop.create_task(self._read(), name="stream-reader")
            watcher = loop.create_task(self._watch_drain(), name="stream-drain-watch")
            while True:
                current = await self._pending.get()
                if current is _END:
                    return
                if current is _DRAIN:
                    raise Draining("the server is shutting down; resend unanswered requests to another replica")
                response = await current
                current = None
                yield response
                self._slots.release()
        except ServiceError as exc:
            error = exc
        except Exception:
            logger.exception("unexpected error in a request stream")
            error = ServiceError("internal error")
        finally:
            # Cancelled by the client, drained, or done: nothing of this stream may keep running
            # (queued rows of cancelled requests leave their batcher uncomputed).
            for task in (reader, watcher, current):
                if isinstance(task, asyncio.Task):
                    task.cancel()
            while not self._pending.empty():
                task = self._pending.get_nowait()
                if isinstance(task, asyncio.Task):
                    task.cancel()
        await self._abort(error)

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        iterator = aiter(self._requests)
        try:
            while True:
                await self._slots.acquire()  # before reading: at most max_in_flight unanswered
                try:
                    request = await anext(iterator)
                except StopAsyncIteration:
                    return
                self._pending.put_nowait(loop.create_task(self._answer_one(request)))
        except asyncio.CancelledError:
            raise
        except Exception:  # the transport failed mid-stream: answer what arrived, then end
            logger.warning("reading a request stream failed", exc_info=True)
        finally:
            self._pending.put_nowait(_END)

    async def _watch_drain(self) -> None:
        await self._drain.wait()
        self._pending.put_nowait(_DRAIN)

    async def _answer_one(self, request: Request) -> Response:
        try:
            return await self._answer(request)
        except ServiceError as exc:
            return self._on_error(request, exc.code, exc.reason, exc.message)
        except Exception:
            logger.exception("unexpected error answering a streamed request")
            return self._on_error(request, "INTERNAL", "INTERNAL", "internal error")
