"""Inference cache keys: which guarded feature row, scored by which model, an entry is for."""

from __future__ import annotations

import hashlib

import numpy as np

from mlpair.contracts.target import ModelTarget

# bumped with the key's or the stored value's layout: releases never read each other's entries
# (v3: the row's hash is SHA-256's first 128 bits)
KEY_LAYOUT = "v3"


def cache_key(target: ModelTarget, row: np.ndarray) -> str:
    """The cache key of one guarded feature row ``[n_features] float32`` scored by ``target``."""
    digest = hashlib.sha256(np.ascontiguousarray(row, dtype="<f4").tobytes()).hexdigest()[:32]
    return _key_prefix(target) + digest


def _key_prefix(target: ModelTarget) -> str:
    return f"{KEY_LAYOUT}|{target.name}|{target.version}|{target.feature_version}|"


def cache_keys(target: ModelTarget, rows: np.ndarray) -> list[str]:
    """:func:`cache_key` of each row of ``rows`` ``[batch, n_features] float32``: the matrix's
    bytes taken once, the key's prefix written once, and every row sliced and hashed."""
    data = np.ascontiguousarray(rows, dtype="<f4")
    if data.ndim != 2 or not data.shape[1]:
        return [cache_key(target, row) for row in rows]
    prefix, raw, width = _key_prefix(target), data.tobytes(), data.shape[1] * 4
    sha256 = hashlib.sha256
    return [prefix + sha256(raw[i : i + width]).hexdigest()[:32] for i in range(0, len(raw), width)]
