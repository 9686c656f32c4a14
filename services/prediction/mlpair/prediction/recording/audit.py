"""Audit records: what each decision was based on, stored beside it in the decision ledger.

A credit or churn decision must be auditable from what the system stores. Besides the decision
itself (``decision_ledger``: decision, probability, reason codes, versions, caller), each decision
gets one audit record in ``decision_audit``, committed by the same statement (``ledger_0005``), as
one JSON object, read back by :func:`read_record` as::

    {"attributes": {...}, "unknown_attributes": [...], "features": [...], "guards": [[feature, action], ...],
     "logits": [...], "explanation": {...} | null, "preprocessing_hash": "sha256:…"}

* ``attributes``: the attributes the family's schema reads, as received (a number, a string, a
  boolean or null; an attribute not sent is absent). Attributes the schema flags
  ``personal_data = true`` are, as configured (``PREDICTION_AUDIT_PERSONAL_DATA``), left out
  (``drop``, the default) or stored as a keyed hash (``hash``): ``"hmac-sha256:<hex>"``, HMAC-SHA256
  (RFC 2104) under a secret key (``PREDICTION_AUDIT_HASH_KEY``) over ``<attribute name>:<the value
  as received, as compact JSON>`` (:meth:`AuditRecords.keyed_hash`; ``Income:129.0``,
  ``Marital:"married"``). A keyed hash lets an auditor holding the key check a claimed value, while
  a reader of the ledger cannot enumerate an income's few thousand values into the hash (a plain
  hash would give them away); the name in it keeps equal values of two attributes apart. Equal
  values of one attribute have equal hashes: that much a reader can see.
* ``unknown_attributes``: names the schema does not know, without their values (the schema cannot
  say whether they are personal).
* ``features``: the vector the model saw, ``[n_features]`` float32, with the columns built from
  personal attributes null in both modes (the preprocessing beside the model would turn them back
  into the values); ``guards``: each guard that fired on the row, as ``[feature, action]``.
* ``logits``: the served version's raw output for the row, ``[n_classes]`` float32 (the first
  member's for an ensemble; null when no model output was used; a non-finite value reads as null).
* ``explanation``: when the request asked for one, every feature's contribution
  (``[feature, contribution, reason_code]``, probability units) and the top reasons.
* ``preprocessing_hash``: the third member of the version triple (the ledger keeps the model and
  feature schema versions), naming the preprocessing that built ``features``.

The two vectors are stored as base64 of their little-endian float32 bytes (``features_f32``,
``logits_f32``): exact, and written without a decimal conversion per value, which cost more CPU
per decision than the rest of the record (docs/decisions/0016-audit-vectors-as-float32-bytes.md);
:func:`read_record` gives them back as lists.

Retention (``PREDICTION_AUDIT_RETENTION_DAYS``) deletes audit records older than the setting; the
decision stays in the ledger for its idempotency and its delivery. ``mlpair decision REQUEST_ID``
shows one decision with its record.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from mlpair.prediction.deciding.decisions import Decided
    from mlpair.prediction.deciding.explain import Explanation
    from mlpair.prediction.families import ModelFamily

PERSONAL_DATA_MODES = ("drop", "hash")
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False, default=lambda v: v.item()).encode


class _Layout(NamedTuple):
    """What a family's records share: the attributes kept as received, those hashed (none unless
    hashing), every attribute the schema knows, the vector's columns built from personal
    attributes, and the record's constant end."""

    plain: list[str]
    hashed: list[str]
    known: frozenset[str]
    personal_columns: list[int]
    tail: str


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
        self._layouts: dict[str, tuple[Any, _Layout]] = {}

    def _layout(self, family: ModelFamily) -> _Layout:
        """Per family, made once for its entry (see :class:`_Layout`)."""
        layout = self._layouts.get(family.name)
        if layout is None or layout[0] is not family.entry:
            schema = family.schema
            personal = schema.personal_data
            slices = family.assembler.feature_slices
            width = family.assembler.n_features
            made = _Layout(
                [n for n in schema.attribute_names if n not in personal],
                [n for n in schema.attribute_names if n in personal] if self.hash_personal else [],
                frozenset(schema.attribute_names),
                [i for n in sorted(personal) for i in range(*slices[n].indices(width))],
                f',"preprocessing_hash":{_ENCODE(family.entry.manifest.versions.preprocessing_hash)}}}',
            )
            layout = self._layouts[family.name] = (family.entry, made)
        return layout[1]

    def keyed_hash(self, name: str, value: Any) -> str:
        """``"hmac-sha256:<hex>"``: HMAC-SHA256 (RFC 2104) under the key of ``<name>:<value as compact JSON>``."""
        digest = hmac.new(self._key, f"{name}:{_ENCODE(value)}".encode(), hashlib.sha256).hexdigest()
        return f"hmac-sha256:{digest}"

    def records(self, d: Decided) -> list[str]:
        """One JSON text per decided row of ``d``, in ``d.rows`` order (see the module docstring).

        A value JSON cannot hold (a non-finite number) is written as null.
        """
        group, scores = d.group, d.scores
        plain, hashed, known, personal_columns, tail = self._layout(group.family)
        rows = list(d.rows)
        width = group.vectors.shape[1] * 4  # bytes of one row's float32 features
        matrix = group.vectors[rows].astype("<f4", copy=False)  # a copy (rows taken by index)
        if personal_columns:
            matrix[:, personal_columns] = np.nan  # read back as null
        vectors = matrix.tobytes()
        b64, served_rows, guards = base64.b64encode, scores.served, group.guards
        out = []
        for j, k in enumerate(rows):
            received: Mapping[str, Any] = group.requests[k].attributes
            attributes = {n: received[n] for n in plain if n in received}
            for n in hashed:
                if n in received:
                    attributes[n] = self.keyed_hash(n, received[n])
            unknown = [] if received.keys() <= known else sorted(a for a in received if a not in known)
            served = served_rows[k]
            logits = "null" if served is None or served.logits is None else f'"{_f32(served.logits)}"'
            events = guards[k].events
            explanation = d.explanations.get(j)
            # written piece by piece: each piece is JSON (base64 and "null" need no escaping)
            out.append(
                f'{{"attributes":{_attributes(attributes)},"unknown_attributes":{_ENCODE(unknown)},'
                f'"features_f32":"{b64(vectors[j * width : (j + 1) * width]).decode()}",'
                f'"guards":{_ENCODE([[e.feature, e.action] for e in events]) if events else "[]"},'
                f'"logits_f32":{logits},'
                f'"explanation":{"null" if explanation is None else _encode(_explained(explanation))}{tail}'
            )
        return out


def _attributes(attributes: dict[str, Any]) -> str:
    """The attributes as JSON (a non-finite number as null, see :func:`_encode`)."""
    try:
        return _ENCODE(attributes)
    except ValueError:
        return _encode(attributes)


def _explained(explanation: Explanation) -> dict[str, Any]:
    """An explanation as the record keeps it."""
    return {
        "contributions": [[c.feature, c.contribution, c.reason_code] for c in explanation.contributions],
        "top_reasons": list(explanation.top_reasons),
    }


def _encode(record: Any) -> str:
    """``record`` as compact JSON; a non-finite float (which JSON cannot hold) becomes null."""
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


def _f32(vector: np.ndarray) -> str:
    """``vector``'s values as base64 of little-endian float32 bytes."""
    return base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode("ascii")


def _vector(text: str | None) -> list[float | None] | None:
    """A :func:`_f32` text back as values (a non-finite one as None, which JSON can hold)."""
    if text is None:
        return None
    return _finite(np.frombuffer(base64.b64decode(text), dtype="<f4").tolist())


def read_record(text: str | None) -> dict[str, Any] | None:
    """An audit record's JSON text as a dict with ``features`` and ``logits`` as lists (None stays
    None: no record kept, or past its retention)."""
    if text is None:
        return None
    return {
        (key[:-4] if key in _VECTORS else key): (_vector(value) if key in _VECTORS else value)
        for key, value in json.loads(text).items()
    }


_VECTORS = frozenset({"features_f32", "logits_f32"})
