"""PredictionService from Python: :class:`PredictionClient` (blocking), :class:`AsyncPredictionClient`
(``grpc.aio``) and :func:`to_attributes`; see :mod:`mlpair.client`."""

from __future__ import annotations

import math
import numbers
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from types import TracebackType
from typing import Any, Self, cast

import grpc
import numpy as np

from mlpair.api.prediction.v1 import prediction_service_pb2 as pb
from mlpair.api.prediction.v1 import prediction_service_pb2_grpc as pb_grpc
from mlpair.client.channels import DEFAULT_TIMEOUT_S, open_aio_channel, open_channel
from mlpair.client.errors import item_results
from mlpair.client.outcomes import RecordsOutcomes, RecordsOutcomesAsync

# What an attribute may be given as (the rules are in :func:`to_attributes`): a str, a bool, a real number
# (NumPy's scalars and Decimal too), None or another missing marker, or an AttributeValue as is.
Attribute = float | int | bool | str | Decimal | None | pb.AttributeValue


def to_attributes(mapping: Mapping[str, Attribute]) -> dict[str, pb.AttributeValue]:
    """Python values by attribute name → the ``PredictRequest.attributes`` map. Nothing is guessed: a
    value reaches the feature schema as what it is, or the call fails here.

    - ``str`` (NumPy's too) → ``string_value``, as given (the schema converts it: a category, ``"42"``;
      an empty one is missing there).
    - ``bool`` and ``numpy.bool_`` → ``bool_value``.
    - Any other real number (``int``, ``float``, NumPy integer and floating scalars, ``Fraction``) and
      ``decimal.Decimal`` → ``number_value``, a float64 rounded to the nearest, as every number on the
      wire is (IEEE 754): a value beyond the float64 range (``10**400``, ``-2**1024``,
      ``Fraction(10**400, 3)``, ``Decimal("1e400")``) rounds to an infinity of its sign, whatever its
      type, and is sent as one, as ``float("inf")`` is (the schema clamps a number to its range and
      refuses an infinity where it wants a category code or a flag, naming the attribute); NaN, a
      Decimal's too, is missing.
    - Missing → an empty ``AttributeValue`` (null): ``None``, NaN, ``pandas.NA``, ``pandas.NaT`` and
      NumPy's NaT (``datetime64``/``timedelta64``). pandas is never imported here: its markers exist
      only once the caller has imported it.
    - An ``AttributeValue`` → as given.

    Raises:
        TypeError: a value of any other type — a list, dict, bytes, datetime, ``numpy.timedelta64``,
            complex number… — or a number type whose ``float()`` fails for another reason than its
            size, naming the attribute and the type (never the value); before any request is built
            or sent.
    """
    return {name: _attribute(name, value) for name, value in mapping.items()}


def _attribute(name: str, value: object) -> pb.AttributeValue:
    """One value of :func:`to_attributes`."""
    if isinstance(value, pb.AttributeValue):
        return value
    if value is None or _is_missing_marker(value):
        return pb.AttributeValue()
    if isinstance(value, str):
        return pb.AttributeValue(string_value=value)
    if isinstance(value, (bool, np.bool_)):
        return pb.AttributeValue(bool_value=bool(value))
    # numpy.timedelta64 registers as an integer (its count of units): a duration, not a plain number.
    if isinstance(value, (numbers.Real, Decimal)) and not isinstance(value, np.timedelta64):
        if isinstance(value, Decimal) and value.is_nan():  # float() refuses a signalling NaN
            return pb.AttributeValue()
        number = _float(name, value)
        return pb.AttributeValue() if math.isnan(number) else pb.AttributeValue(number_value=number)
    raise TypeError(
        f"attribute {name!r}: a {_type_name(value)} cannot be sent; give a str, a bool, a real number or None (missing)"
    )


def _float(name: str, value: numbers.Real | Decimal) -> float:
    """``value`` rounded to the nearest float64 (IEEE 754). ``int`` and ``Fraction`` raise
    ``OverflowError`` where that rounding gives an infinity (``Decimal`` and NumPy's long double
    return it): the infinity of the value's sign here, so equal values get one number whatever
    their type.

    Raises:
        TypeError: ``float()`` fails for another reason (a number type of the caller's own), naming
            the attribute and the type.
    """
    try:
        return float(value)
    except OverflowError:
        return math.inf if cast(float, value) > 0 else -math.inf  # Decimal and Real compare with 0 alike
    except (TypeError, ValueError, ArithmeticError):  # its text may hold the value: not chained
        raise TypeError(f"attribute {name!r}: a {_type_name(value)} cannot be read as a number") from None


def _type_name(value: object) -> str:
    """``numpy.datetime64``, ``list``: the module (but builtins) and the qualified name of the type."""
    kind = type(value)
    module = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
    return f"{module}{kind.__qualname__}"


def _is_missing_marker(value: object) -> bool:
    """pandas' NA and NaT, and NumPy's NaT (``datetime64`` or ``timedelta64``)."""
    if isinstance(value, (np.datetime64, np.timedelta64)):
        return bool(np.isnat(value))
    pandas = sys.modules.get("pandas")
    return pandas is not None and (value is pandas.NA or value is pandas.NaT)


def predict_request(
    family: str,
    entity_id: str,
    attributes: Mapping[str, Attribute],
    request_id: str | None = None,
    explain: bool = False,
) -> pb.PredictRequest:
    """One ``PredictRequest``; a new request id (UUID4) when ``request_id`` is None. An empty id is
    sent as it is, and PredictionService refuses it (INVALID_ARGUMENT): an id the caller meant to
    give but lost must not become a new decision on every retry.

    Raises:
        TypeError: an attribute of a type that cannot be sent (:func:`to_attributes`).
    """
    return pb.PredictRequest(
        request_id=str(uuid.uuid4()) if request_id is None else request_id,
        entity_id=entity_id,
        model_name=family,
        attributes=to_attributes(attributes),
        explain=explain,
    )


@dataclass(frozen=True)
class BatchItem:
    """One item of :meth:`PredictionClient.batch_predict`: the arguments of one ``predict``."""

    family: str
    entity_id: str
    attributes: Mapping[str, Attribute]
    request_id: str | None = None
    explain: bool = False


@dataclass(frozen=True)
class ItemError:
    """A refused ``BatchPredict`` item: the status ``Predict`` would have raised for it, with the
    same ErrorInfo detail (``reason`` and ``metadata``; :func:`mlpair.rpc.error_info` reads it from a
    ``Predict``'s ``grpc.RpcError``)."""

    code: grpc.StatusCode
    message: str
    reason: str  # the ErrorInfo reason, e.g. "UNKNOWN_ATTRIBUTE"; empty if the server sent none
    # the ErrorInfo metadata, e.g. {"attributes": "Incme", "did_you_mean": "Incme=Income"}; empty if none
    metadata: Mapping[str, str] = field(default_factory=dict)


def _batch_request(items: Sequence[BatchItem]) -> pb.BatchPredictRequest:
    return pb.BatchPredictRequest(
        requests=[predict_request(i.family, i.entity_id, i.attributes, i.request_id, i.explain) for i in items]
    )


def _outcomes(reply: pb.BatchPredictResponse) -> list[pb.PredictResponse | ItemError]:
    return item_results(reply.results, "outcome", "prediction", ItemError)


class _Client:
    """What both clients share: their arguments, the target, the default deadline, the stub over one
    channel (opened by the client's ``_open``: a blocking or a ``grpc.aio`` one)."""

    _open: Callable[[str, grpc.ChannelCredentials | None, Sequence[tuple[str, int]]], grpc.Channel | grpc.aio.Channel]

    def __init__(
        self,
        target: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        options: Sequence[tuple[str, int]] = (),
    ) -> None:
        self._channel = self._open(target, credentials, options)
        self.target = target
        self.timeout_s = timeout_s
        self._stub = pb_grpc.PredictionServiceStub(self._channel)

    def _deadline(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else timeout_s


class PredictionClient(_Client, RecordsOutcomes):
    """Blocking PredictionService client over one channel; close it, or use it as a context manager.

    Args:
        target: ``host:port`` of PredictionService (its default port is 9001).
        credentials: TLS (or mTLS) channel credentials, e.g. :func:`mlpair.rpc.channel_credentials`;
            None = plaintext.
        timeout_s: deadline of each call in seconds, unless the call names its own.
        options: extra gRPC channel options (``(name, value)`` pairs).

    Every call raises ``grpc.RpcError`` when refused: INVALID_ARGUMENT (an attribute the family's
    feature schema rejects, or an unknown one; an empty or malformed id), NOT_FOUND (unknown family), ALREADY_EXISTS (the
    request id is on record for another payload), FAILED_PRECONDITION (the model and feature
    versions disagree), RESOURCE_EXHAUSTED (shedding load: retry later), UNAVAILABLE (the service,
    its model or its decision ledger cannot be reached; nothing was recorded: retry with the same
    request id), DEADLINE_EXCEEDED, INTERNAL (a model failure).
    """

    _channel: grpc.Channel
    _open = staticmethod(open_channel)

    def predict(
        self,
        family: str,
        entity_id: str,
        attributes: Mapping[str, Attribute],
        request_id: str | None = None,
        explain: bool = False,
        *,
        timeout_s: float | None = None,
    ) -> pb.PredictResponse:
        """One decision about ``entity_id`` by the model ``family`` (e.g. ``"credit-risk"``).

        Args:
            attributes: raw attributes by name (:func:`to_attributes`); a left-out attribute takes
                its schema default and adds a ``<FEATURE>_MISSING_DEFAULTED`` reason code.
            request_id: the idempotency key; None = a new UUID4. The same id sent again returns the
                decision recorded first (``replayed`` set).
            explain: also per-feature ``contributions`` and ``top_reasons`` (costs one inference
                call of 1 + number of features rows).
            timeout_s: this call's deadline in seconds; None = the client's.

        Returns:
            The recorded decision: ``decision_label``, calibrated ``probability`` in [0, 1],
            ``reason_codes``, the model, schema and policy versions, ``request_id`` and
            ``decision_id``.

        Raises:
            grpc.RpcError: refused; the codes are listed on the class.
            TypeError: an attribute of a type that cannot be sent (:func:`to_attributes`); nothing was sent.
        """
        request = predict_request(family, entity_id, attributes, request_id, explain)
        return self._stub.Predict(request, timeout=self._deadline(timeout_s))

    def explain(
        self,
        family: str,
        entity_id: str,
        attributes: Mapping[str, Attribute],
        request_id: str | None = None,
        *,
        timeout_s: float | None = None,
    ) -> pb.PredictResponse:
        """:meth:`predict` with ``explain=True``: the decision with its contributions and top reasons."""
        return self.predict(family, entity_id, attributes, request_id, explain=True, timeout_s=timeout_s)

    def batch_predict(
        self, items: Sequence[BatchItem], *, timeout_s: float | None = None
    ) -> list[pb.PredictResponse | ItemError]:
        """Many decisions in one ``BatchPredict`` call; items may name different families.

        Returns:
            One outcome per item, in order: the decision, or the :class:`ItemError` that item alone
            met (a bad item never fails the others).

        Raises:
            grpc.RpcError: the whole call was refused: INVALID_ARGUMENT (more items than the service
                takes at once, ``PREDICTION_MAX_BATCH_ITEMS``), UNAVAILABLE, RESOURCE_EXHAUSTED,
                DEADLINE_EXCEEDED.
            TypeError: an item's attribute of a type that cannot be sent (:func:`to_attributes`); nothing
                was sent.
        """
        reply = self._stub.BatchPredict(_batch_request(items), timeout=self._deadline(timeout_s))
        return _outcomes(reply)

    def predict_columns(
        self, chunks: Iterable[Any], model_name: str = "", *, timeout_s: float | None = None
    ) -> Iterator[Any]:
        """Decides tables (``request_id``, ``entity_id``, one column per attribute) through one
        ``PredictColumns`` stream: one :class:`~mlpair.client.tables.ChunkResult` per table, in
        order, as each is decided. Needs pyarrow (the client's ``tables`` extra).

        Args:
            chunks: an iterable of tables of at most ``PREDICTION_MAX_CHUNK_ROWS`` rows each: a
                ``pyarrow.Table`` or ``RecordBatch``, a pandas DataFrame (its index is not sent),
                or anything with ``__arrow_c_stream__`` (Polars, DuckDB); ``tables.slices(df, n)``
                cuts one big table.

        Raises:
            TypeError: ``chunks`` is one table rather than an iterable of them, or its first chunk
                is of another type (named); raised here, before the stream starts. A later chunk
                of another type ends the stream there and is raised after the earlier chunks'
                results.
            grpc.RpcError: the stream failed: UNAVAILABLE, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED
                (``timeout_s`` bounds the whole stream; None = the client's). A chunk refused as a
                whole or a row's own error is in its result instead.
        """
        from mlpair.client import tables  # pyarrow: only for the callers of this method

        requests = tables.ChunkRequests(chunks, model_name)
        return requests.results(self._stub.PredictColumns(iter(requests), timeout=self._deadline(timeout_s)))

    def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


class AsyncPredictionClient(_Client, RecordsOutcomesAsync):
    """:class:`PredictionClient` for asyncio (``grpc.aio``): the same arguments, calls and errors,
    each call awaited; many may be in flight on the one channel. Use ``async with`` or ``await
    close()``."""

    _channel: grpc.aio.Channel
    _open = staticmethod(open_aio_channel)

    async def predict(
        self,
        family: str,
        entity_id: str,
        attributes: Mapping[str, Attribute],
        request_id: str | None = None,
        explain: bool = False,
        *,
        timeout_s: float | None = None,
    ) -> pb.PredictResponse:
        """See :meth:`PredictionClient.predict`."""
        request = predict_request(family, entity_id, attributes, request_id, explain)
        return await self._stub.Predict(request, timeout=self._deadline(timeout_s))

    async def explain(
        self,
        family: str,
        entity_id: str,
        attributes: Mapping[str, Attribute],
        request_id: str | None = None,
        *,
        timeout_s: float | None = None,
    ) -> pb.PredictResponse:
        """See :meth:`PredictionClient.explain`."""
        return await self.predict(family, entity_id, attributes, request_id, explain=True, timeout_s=timeout_s)

    async def batch_predict(
        self, items: Sequence[BatchItem], *, timeout_s: float | None = None
    ) -> list[pb.PredictResponse | ItemError]:
        """See :meth:`PredictionClient.batch_predict`."""
        reply = await self._stub.BatchPredict(_batch_request(items), timeout=self._deadline(timeout_s))
        return _outcomes(reply)

    def predict_columns(
        self, chunks: Iterable[Any], model_name: str = "", *, timeout_s: float | None = None
    ) -> AsyncIterator[Any]:
        """See :meth:`PredictionClient.predict_columns` (``async for result in …``); a chunk of a
        type it does not take raises TypeError here, before the stream starts."""
        from mlpair.client import tables

        requests = tables.ChunkRequests(chunks, model_name)
        deadline = self._deadline(timeout_s)
        return requests.async_results(lambda: self._stub.PredictColumns(iter(requests), timeout=deadline))

    async def close(self) -> None:
        """Closes the channel; calls in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.close()
