"""What the wire contract does not define is refused, not ignored (both services, every protocol).

Silently ignoring what a server cannot honour turns a caller's intent into something else: a
newer client's field (a new attribute value kind, a new request option) would be dropped and the
request answered as if it had never been sent; two different ``x-feature-version`` values would
be read as whichever came first. So, before any handler runs:

* **Unknown fields** (field numbers this server's ``.proto`` files do not declare, at any depth:
  a request, its tensors, its attribute values, its parameters, a map's entries) are refused
  INVALID_ARGUMENT, reason ``UNKNOWN_FIELD``, naming each by its path from the request and its
  number (:func:`unknown_fields`: ``inputs[0] field 99``, ``attributes['Income'] field 4`` in an
  attribute's value, ``requests[0].attributes['Income'] entry field 3`` in a map entry itself).
  Found in the deserializer
  (:func:`parse_strictly`): a protobuf parser keeps unknown fields, and dropping them changes the
  message's size — two size computations and one pass in C; the names are worked out only for
  a request being refused.
* **Conflicting duplicate metadata**: a key this project defines as single-valued
  (:data:`SINGLE_VALUED`) sent twice with different values is refused INVALID_ARGUMENT, reason
  ``CONFLICTING_METADATA``, naming the key. The same value twice is one value.

Deployment order follows: a server learns a field before any client sends it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from mlpair.contracts import FEATURE_VERSION_KEY
from mlpair.errors import ServiceError

SINGLE_VALUED = (FEATURE_VERSION_KEY, "x-request-id")
"""Metadata keys that carry one value: the feature schema version and the business request id."""
MAX_NAMED = 5  # unknown fields named in one error
_WIRE_TYPES = {0: "a varint", 1: "8 bytes", 2: "length-delimited bytes", 3: "a group", 5: "4 bytes"}


class UnknownField(ServiceError):
    """The request carries fields this server's contract does not define; it cannot honour them."""

    code = "INVALID_ARGUMENT"
    reason = "UNKNOWN_FIELD"


class ConflictingMetadata(ServiceError):
    """A single-valued metadata key was sent with two different values."""

    code = "INVALID_ARGUMENT"
    reason = "CONFLICTING_METADATA"


class Refused:
    """Stands in for a request message the deserializer refused; the handler raises ``error``."""

    __slots__ = ("error",)

    def __init__(self, error: ServiceError) -> None:
        self.error = error


def parse_strictly(deserialize: Callable[[bytes], Message]) -> Callable[[bytes], Message | Refused]:
    """Wraps a generated deserializer: a message with unknown fields becomes :class:`Refused`
    (raises DecodeError, as the wrapped one, for bytes that are no message)."""

    def parse(data: bytes) -> Message | Refused:
        message = deserialize(data)
        size = message.ByteSize()
        message.DiscardUnknownFields()
        if message.ByteSize() == size:
            return message
        try:
            named = unknown_fields(deserialize(data))
        except Exception:  # noqa: BLE001  (naming them must not turn a refusal into an UNKNOWN)
            named = [f"{message.DESCRIPTOR.full_name} (fields not named)"]
        shown = ", ".join(named[:MAX_NAMED]) + (f" and {len(named) - MAX_NAMED} more" if len(named) > MAX_NAMED else "")
        return Refused(
            UnknownField(
                f"the request carries fields this server's contract does not define, so it cannot honour them: "
                f"{shown}; upgrade the server first or leave them out",
                metadata={"fields": shown[:256]},
            )
        )

    return parse


def unknown_fields(message: Message, path: str = "") -> list[str]:
    """Every unknown field in ``message`` and the messages it holds, each as its path from the
    request and its number: ``path field N`` (``path`` is the message's full name at the top,
    then ``inputs[0]``, ``attributes['Income']``, ``requests[2].attributes['Income']``…).

    A field number the message declares can be among its unknown fields too, and is then named
    for what it is: a map entry carrying a field of its own that the contract does not define
    (the parser keeps such an entry out of the map, as an unknown field of the map's number) is
    read as the entry it is, ``attributes['Income'] entry field 3``, its value searched as any
    value is; a declared field sent with another wire type is named with the type it came as.
    """
    where = path or message.DESCRIPTOR.full_name
    declared_fields = message.DESCRIPTOR.fields_by_number
    found = []
    for field in UnknownFieldSet(message):
        declared = declared_fields.get(field.field_number)
        if declared is None:
            found.append(f"{where} field {field.field_number}")
            continue
        name = f"{path}.{declared.name}" if path else declared.name
        if field.wire_type == 2 and declared.type == FieldDescriptor.TYPE_MESSAGE and _is_map(declared):
            found += _map_entry(declared, field.data, name)
        else:
            sent = _WIRE_TYPES.get(field.wire_type, f"wire type {field.wire_type}")
            found.append(
                f"{where} field {field.field_number} ({declared.name}) sent as {sent}, not as its declared type"
            )
    for descriptor, value in message.ListFields():
        if descriptor.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        name = f"{path}.{descriptor.name}" if path else descriptor.name
        if _is_map(descriptor):
            if descriptor.message_type.fields_by_name["value"].type == FieldDescriptor.TYPE_MESSAGE:
                for key, item in value.items():
                    found += unknown_fields(item, f"{name}[{str(key)[:64]!r}]")
        elif descriptor.is_repeated:
            for i, item in enumerate(value):
                found += unknown_fields(item, f"{name}[{i}]")
        else:
            found += unknown_fields(value, name)
    return found


def _is_map(descriptor: FieldDescriptor) -> bool:
    return descriptor.message_type is not None and descriptor.message_type.GetOptions().map_entry


def _map_entry(descriptor: FieldDescriptor, data: bytes, name: str) -> list[str]:
    """The unknown fields of one map entry the parser kept out of the map ``name``: the entry's
    own (``name['key'] entry field N``) and its value's (``name['key'] field N``)."""
    try:
        entry = message_factory.GetMessageClass(descriptor.message_type).FromString(data)
    except DecodeError:
        return [f"{name} entry (not a readable map entry)"]
    at = f"{name}[{str(entry.key)[:64]!r}]"
    found = [f"{at} entry field {field.field_number}" for field in UnknownFieldSet(entry)]
    if descriptor.message_type.fields_by_name["value"].type == FieldDescriptor.TYPE_MESSAGE and entry.HasField("value"):
        found += unknown_fields(entry.value, at)
    return found


def check_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> None:
    """Refuses a call whose single-valued metadata keys (:data:`SINGLE_VALUED`, any case) carry
    two different values.

    Raises:
        ConflictingMetadata: naming the key.
    """
    seen: dict[str, str | bytes] = {}
    for key, value in metadata or ():
        key = key.lower()
        if key not in SINGLE_VALUED:
            continue
        if seen.setdefault(key, value) != value:
            raise ConflictingMetadata(
                f"metadata {key!r} was sent with two different values; send one", metadata={"key": key}
            )
