"""The idempotency key's payload check: a canonical fingerprint of what a request asks for.

A request id names one decision. A retry (same id, same payload) gets the recorded decision; the
same id with another payload is a caller's bug — or two callers sharing ids — and is refused
(``IDEMPOTENCY_KEY_REUSED``) instead of being answered with a decision about somebody else. The
payload is compared through :func:`request_fingerprint`, so encodings the wire contract treats
as equal compare equal: attribute order, and every spelling of a missing value (absent, null,
NaN, empty string; README "Feature schema, conversion rules and guards").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

_CANONICAL = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def request_fingerprint(model_name: str, entity_id: str, attributes: Mapping[str, Any]) -> str:
    """SHA-256 (64 hex characters) of the canonical request.

    Args:
        model_name: the model family that decides (the resolved name, never "" for the default).
        entity_id: the business id of the entity.
        attributes: raw attribute values (float, str, bool or None).

    The canonical form is the JSON array ``[model_name, entity_id, [[name, value], …]]`` with
    attributes sorted by name and missing values left out; JSON keeps ``1.0``, ``"1"`` and
    ``true`` apart, as the feature schema's conversion rules do.
    """
    # _missing() inlined: a call per attribute cost more than the rest of the fingerprint
    present = sorted(
        [
            (name, value)
            for name, value in attributes.items()
            if value is not None and value != "" and not (isinstance(value, float) and value != value)
        ]
    )
    return hashlib.sha256(_CANONICAL.encode([model_name, entity_id, present]).encode()).hexdigest()


def request_fingerprints(model_name: str, entity_ids: Sequence[str], records: Sequence[Mapping[str, Any]]) -> list[str]:
    """:func:`request_fingerprint` of many requests of one family, the same hex digests.

    The canonical JSON is assembled from per-value fragments instead of being encoded row by row:
    each attribute's ``["name",value]`` text is made once per distinct string or flag and by
    ``float.__repr__`` (what the JSON encoder writes) for finite numbers. A row with another key
    set than the first row's, a missing value, a non-finite number or a value of another type is
    fingerprinted by :func:`request_fingerprint` itself.
    """
    if len(records) < 8:  # a few rows: building the fragments would cost more than it saves
        return [request_fingerprint(model_name, e, r) for e, r in zip(entity_ids, records)]
    names = sorted(records[0])
    keys = records[0].keys()
    fragments = [_Fragments(name) for name in names]
    out = []
    sha256, encode = hashlib.sha256, _CANONICAL.encode
    head = encode(model_name)
    for entity_id, record in zip(entity_ids, records):
        if record.keys() == keys:
            parts = [f.of(record[f.name]) for f in fragments]
            if _complete(parts):
                text = f"[{head},{encode(entity_id)},[{','.join(parts)}]]"
                out.append(sha256(text.encode()).hexdigest())
                continue
        out.append(request_fingerprint(model_name, entity_id, record))
    return out


def _complete(parts: list[str | None]) -> TypeGuard[list[str]]:
    """Whether every attribute had a fragment (None: that value is fingerprinted row by row)."""
    return None not in parts


class _Fragments:
    """The canonical JSON fragment ``["name",value]`` of one attribute's values (None: not this way)."""

    __slots__ = ("name", "_head", "_memo")

    def __init__(self, name: str) -> None:
        self.name = name
        self._head = f"[{_CANONICAL.encode(name)},"
        self._memo: dict[tuple[type, Any], str] = {}

    def of(self, value: Any) -> str | None:
        kind = type(value)
        if kind is float:
            if value - value != 0.0:  # NaN (missing) or an infinity: row by row
                return None
            return f"{self._head}{float.__repr__(value)}]"
        if kind is str or kind is bool:
            key = (kind, value)  # the type in the key: True and 1.0 are equal dictionary keys
            found = self._memo.get(key)
            if found is None:
                if value == "":
                    return None
                found = f"{self._head}{_CANONICAL.encode(value)}]"
                if len(self._memo) < 4096:
                    self._memo[key] = found
            return found
        return None
