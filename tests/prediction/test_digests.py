"""``mlpair._digests``: a batch's SHA-256 fingerprints, UUIDv5 decision ids and cache keys through OpenSSL,
the same values as ``hashlib`` and ``uuid`` give, and the same outcomes where it is not built."""

from __future__ import annotations

import hashlib
import os
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlpair.contracts.target import ModelTarget
from mlpair.prediction import idempotency, records
from mlpair.prediction.records import decision_id_for, decision_ids_for
from mlpair.prediction.scoring import cache

try:
    from mlpair import _digests
except ImportError:  # setup.py builds it optionally (no OpenSSL headers: Python computes the same)
    _digests = None  # type: ignore[assignment]

needs_digests = pytest.mark.skipif(_digests is None, reason="mlpair._digests is not built here; CI requires it")


def test_the_compiled_digests_are_built_and_in_use_where_ci_runs() -> None:
    """Without OpenSSL's headers the install falls back silently (setup.py: optional); CI's
    machine has them, so there the module must be built and used."""
    if os.environ.get("CI") != "true" and _digests is None:
        pytest.skip("mlpair._digests is not built here (no OpenSSL headers?); CI requires it")
    assert _digests is not None
    assert idempotency._sha256_hex is _digests.sha256_hex
    assert records._uuid5_ids is _digests.uuid5_ids
    assert cache._row_keys is _digests.row_keys


@needs_digests
@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.binary(max_size=600)), max_size=40))
def test_sha256_hex_is_hashlibs_hexdigest_of_each_text(texts) -> None:
    assert _digests.sha256_hex(texts) == [None if t is None else hashlib.sha256(t).hexdigest() for t in texts]


@needs_digests
@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=80), max_size=40), st.binary(min_size=16, max_size=16))
def test_uuid5_ids_are_the_rfc_4122_name_based_ids(names, namespace) -> None:
    """Any text (non-ASCII, NUL, astral) in any namespace: ``str(uuid.uuid5(...))``."""
    expected = [str(uuid.uuid5(uuid.UUID(bytes=namespace), name)) for name in names]
    assert _digests.uuid5_ids(namespace, names) == expected


@needs_digests
def test_the_digests_refuse_what_python_would() -> None:
    """Wrong types and a namespace of another length raise, as does a lone surrogate (which
    ``str.encode`` refuses too); nothing half-made is returned."""
    namespace = uuid.NAMESPACE_URL.bytes
    with pytest.raises(TypeError):
        _digests.sha256_hex([b"a", "not bytes"])
    with pytest.raises(TypeError):
        _digests.sha256_hex((b"a",))
    with pytest.raises(ValueError):
        _digests.uuid5_ids(namespace[:15], ["a"])
    with pytest.raises(TypeError):
        _digests.uuid5_ids(namespace, ["a", 1])
    with pytest.raises(UnicodeEncodeError):
        _digests.uuid5_ids(namespace, ["a", "\ud800"])
    with pytest.raises(UnicodeEncodeError):
        "\ud800".encode()


@pytest.mark.parametrize("n", [0, 1, 31, 32, 500])
def test_decision_ids_of_a_batch_are_each_ids_own_both_ways(n, monkeypatch) -> None:
    """The batch's ids through OpenSSL and through the NumPy path (not built) are each request
    id's :func:`decision_id_for`, at every size either path chooses differently."""
    request_ids = [f"req-{i}-é" for i in range(n)]
    expected = [decision_id_for(r) for r in request_ids]
    assert decision_ids_for(request_ids) == expected
    monkeypatch.setattr(records, "_uuid5_ids", None)
    assert decision_ids_for(request_ids) == expected


def test_fingerprints_of_a_batch_are_the_same_without_the_compiled_digests(monkeypatch) -> None:
    """hashlib's digests where ``mlpair._digests`` is not built: the same fingerprints, each row's
    own (rows with another key set fall back to the row-wise fingerprint either way)."""
    rows = [{"Age": float(20 + i), "Home": "owner", "Flag": i % 2 == 0} for i in range(12)] + [{"Age": 1.0}]
    entity_ids = [f"e-{i}" for i in range(len(rows))]
    expected = [idempotency.request_fingerprint("credit-risk", e, r) for e, r in zip(entity_ids, rows)]
    assert idempotency.request_fingerprints("credit-risk", entity_ids, rows) == expected
    monkeypatch.setattr(idempotency, "_sha256_hex", None)
    assert idempotency.request_fingerprints("credit-risk", entity_ids, rows) == expected


@needs_digests
@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=480), st.sampled_from([1, 4, 8, 120]), st.text(max_size=30))
def test_row_keys_are_the_prefix_and_each_rows_sha256(data, width, prefix) -> None:
    """Any prefix (non-ASCII too) and any row width: ``prefix + sha256(row).hexdigest()[:32]``."""
    data = data[: len(data) - len(data) % width]
    expected = [prefix + hashlib.sha256(data[i : i + width]).hexdigest()[:32] for i in range(0, len(data), width)]
    assert _digests.row_keys(prefix, data, width) == expected


@needs_digests
def test_row_keys_refuse_a_width_that_does_not_cut_the_rows() -> None:
    for width in (0, -4, 7):
        with pytest.raises(ValueError):
            _digests.row_keys("p|", bytes(120), width)


def test_cache_keys_of_a_batch_are_each_rows_own_both_ways(monkeypatch) -> None:
    """The batch's keys through OpenSSL and through hashlib (not built) are each row's
    :func:`cache.cache_key`; rows differing in one bit or in the target get other keys."""
    rows = np.random.default_rng(3).normal(size=(64, 30)).astype(np.float32)
    rows[1] = np.nextafter(rows[0], np.float32(2))
    target = ModelTarget("credit-risk", "1", "credit-risk/v1")
    expected = [cache.cache_key(target, row) for row in rows]
    assert len(set(expected)) == len(rows)
    assert cache.cache_keys(target, rows) == expected
    monkeypatch.setattr(cache, "_row_keys", None)
    assert cache.cache_keys(target, rows) == expected
    assert not set(expected) & set(cache.cache_keys(ModelTarget("credit-risk", "2", "credit-risk/v1"), rows))
