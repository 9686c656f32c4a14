"""Audit records: what each decision was based on, stored beside it in the decision ledger.

A credit or churn decision must be auditable from what the system stores. Besides the decision
itself (``decision_ledger``: decision, probability, reason codes, versions, caller), each decision
gets one audit record in ``decision_audit``, committed by the same statement (``ledger_0005``), as
one JSON object::

    {"attributes": {...}, "unknown_attributes": [...], "features": [...], "guards": [[feature, action], ...],
     "logits": [...], "explanation": {...} | null, "preprocessing_hash": "sha256:…"}

* ``attributes``: the attributes the family's schema reads, as received (a number, a string, a
  boolean or null; an attribute not sent is absent). Attributes the schema flags
  ``personal_data = true`` are, as configured (``PREDICTION_AUDIT_PERSONAL_DATA``), left out
  (``drop``, the default) or stored as a keyed hash (``hash``): ``"hmac-sha256:<hex>"``, HMAC-SHA256
  (RFC 2104) under a secret key (``PREDICTION_AUDIT_HASH_KEY``) over the value's JSON text. A keyed
  hash lets an auditor holding the key check a claimed value, while a reader of the ledger cannot
  enumerate an income's few thousand values into the hash (a plain hash would give them away).
* ``unknown_attributes``: names the schema does not know, without their values (the schema cannot
  say whether they are personal).
* ``features``: the vector the model saw, ``[n_features]`` (float32 values written as the doubles
  they equal); ``guards``: each guard that fired on the row, as ``[feature, action]``.
* ``logits``: the served version's raw output for the row, ``[n_classes]`` (the first member's for an
  ensemble; null when no model output was used, and a non-finite value is null).
* ``explanation``: when the request asked for one, every feature's contribution
  (``[feature, contribution, reason_code]``, probability units) and the top reasons.
* ``preprocessing_hash``: the third member of the version triple (the ledger keeps the model and
  feature schema versions), naming the preprocessing that built ``features``.

Retention (``PREDICTION_AUDIT_RETENTION_DAYS``) deletes audit records older than the setting; the
decision stays in the ledger for its idempotency and its delivery. ``mlpair decision REQUEST_ID``
shows one decision with its record.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlpair.prediction.deciding.decisions import Decided

PERSONAL_DATA_MODES = ("drop", "hash")
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False, default=lambda v: v.item()).encode


class AuditRecords:
    """Builds the audit records of decided rows, with personal data dropped or hashed.

    Args:
        personal_data: ``drop`` leaves schema-flagged personal attributes out; ``hash`` stores
            their keyed hash.
        hash_key: the HMAC key for ``hash`` (a secret; at least 16 bytes).

    Raises:
        ValueError: an unknown mode, or ``hash`` without a key of at least 16 bytes.
    """

    def __init__(self, personal_data: str = "drop", hash_key: bytes = b"") -> None:
        if personal_data not in PERSONAL_DATA_MODES:
            raise ValueError(f"personal data in audit records is one of {PERSONAL_DATA_MODES}, not {personal_data!r}")
        if personal_data == "hash" and len(hash_key) < 16:
            raise ValueError("hashing personal data in audit records needs a key of at least 16 bytes")
        self.hash_personal = personal_data == "hash"
        self._key = hash_key

    def keyed_hash(self, value: Any) -> str:
        """``"hmac-sha256:<hex>"`` of ``value``'s compact JSON text under the key (RFC 2104)."""
        digest = hmac.new(self._key, _ENCODE(value).encode(), hashlib.sha256).hexdigest()
        return f"hmac-sha256:{digest}"

    def records(self, d: Decided) -> list[str]:
        """One JSON text per decided row of ``d``, in ``d.rows`` order (see the module docstring).

        Raises:
            ValueError: an attribute value JSON cannot hold (NaN or infinity is refused by intake first).
        """
        group, scores = d.group, d.scores
        schema = group.family.schema
        names = schema.attribute_names
        personal = schema.personal_data
        known = frozenset(names)
        vectors = group.vectors
        preprocessing_hash = group.family.entry.preprocessing.hash
        out = []
        for j, k in enumerate(d.rows):
            received: Mapping[str, Any] = group.requests[k].attributes
            attributes: dict[str, Any] = {}
            for name in names:
                if name in received:
                    value = received[name]
                    if name in personal:
                        if not self.hash_personal:
                            continue
                        value = self.keyed_hash(value)
                    attributes[name] = value
            served = scores.served[k]
            explanation = d.explanations.get(j)
            out.append(
                _encode(
                    {
                        "attributes": attributes,
                        "unknown_attributes": sorted(a for a in received if a not in known),
                        "features": vectors[k].tolist(),
                        "guards": [[e.feature, e.action] for e in group.guards[k].events],
                        "logits": None if served is None or served.logits is None else served.logits.tolist(),
                        "explanation": None
                        if explanation is None
                        else {
                            "contributions": [
                                [c.feature, c.contribution, c.reason_code] for c in explanation.contributions
                            ],
                            "top_reasons": list(explanation.top_reasons),
                        },
                        "preprocessing_hash": preprocessing_hash,
                    }
                )
            )
        return out


def _encode(record: dict[str, Any]) -> str:
    """``record`` as compact JSON; a non-finite float (a model's NaN logit, decided as
    ``MODEL_OUTPUT_INVALID``) becomes null, which JSON can hold."""
    try:
        return _ENCODE(record)
    except ValueError:
        return _ENCODE(_finite(record))


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def read_record(text: str | None) -> dict[str, Any] | None:
    """An audit record's JSON text as a dict (None stays None: no record, or past retention)."""
    return None if text is None else json.loads(text)
