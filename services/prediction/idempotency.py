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
from collections.abc import Mapping
from typing import Any

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
    present = sorted([(name, value) for name, value in attributes.items()
                      if value is not None and value != "" and not (isinstance(value, float) and value != value)])
    return hashlib.sha256(_CANONICAL.encode([model_name, entity_id, present]).encode()).hexdigest()

