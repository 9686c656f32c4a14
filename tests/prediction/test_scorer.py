"""Scoring merged Predicts' items (services/prediction/mlpair/prediction/scoring/scorer.py, ``score_groups`` with
``callers``): each item's row is scored in its own caller's task, and the rows that were scored
are calibrated together afterwards. Calibration is row-wise, so each item must get, bit for bit,
the probability the BatchPredict path (calls of many rows) gives it, and a row that cannot be
calibrated fails its own item alone."""

from __future__ import annotations

import asyncio
import contextvars
from types import SimpleNamespace

import numpy as np
import pytest

from mlpair.contracts.assembly import FeatureAssembler
from mlpair.contracts.columns import ColumnAssembler
from mlpair.prediction.errors import InferenceFailed
from mlpair.prediction.intake.merging import MergedCall
from mlpair.prediction.outcomes import PredictInput
from mlpair.prediction.preparing.batch import Group
from mlpair.prediction.scoring.calibration import Calibrator
from mlpair.prediction.scoring.rows import ScoredRows, Source
from mlpair.prediction.scoring.scorer import score_groups

POISON = 99.0  # a logit the test calibrator refuses, as a malformed tensor is refused


class RefusingCalibrator:
    """The real calibrator, refusing any call whose logits hold :data:`POISON`."""

    def __init__(self, calibrator: Calibrator) -> None:
        self.calibrator = calibrator

    def probabilities_per_row(self, logits: np.ndarray):
        if (logits == POISON).any():
            raise InferenceFailed("the model returned logits that cannot be calibrated")
        return self.calibrator.probabilities_per_row(logits)


def _group(entry, records: list[dict], members: int) -> Group:
    calibrator = RefusingCalibrator(Calibrator(entry.manifest))
    family = SimpleNamespace(name="credit-risk", members=[SimpleNamespace(calibrator=calibrator)] * members,
                             shadow=None, poisoned_rows=[])
    columns = ColumnAssembler(FeatureAssembler(entry.preprocessing))
    assembled = columns.assemble(records)
    n = len(records)
    return Group(family, list(range(n)), [PredictInput(f"r{k}", f"e{k}", records[k]) for k in range(n)],
                 assembled.matrix, columns.guards(assembled.actions), [f"fp{k}" for k in range(n)])


async def _infer(family, member, matrix: np.ndarray, deadline) -> ScoredRows:
    """Logits from the rows themselves (spread wide, so calibration meets large and small ones)."""
    await asyncio.sleep(0)
    logits = np.stack([np.zeros(len(matrix)), matrix.sum(axis=1) * 0.37 - 2.0], axis=1).astype(np.float32)
    for r, row in enumerate(matrix):
        if any((row == poisoned).all() for poisoned in family.poisoned_rows):
            logits[r, 1] = POISON
    n = len(matrix)
    return ScoredRows(logits, [Source.INFERENCE] * n, ["1"] * n, [0] * n, [""] * n)


def _callers(group: Group) -> list[MergedCall]:
    loop = asyncio.get_running_loop()
    return [MergedCall(request, loop.create_future(), contextvars.copy_context()) for request in group.requests]


@pytest.mark.parametrize("members", [1, 2])
async def test_merged_items_get_bit_for_bit_the_probabilities_of_a_batch(members, credit_entry, credit_holdout):
    records = credit_holdout.records[:120]
    batch, merged = _group(credit_entry, records, members), _group(credit_entry, records, members)
    [batch] = await score_groups([batch], _infer, max_rows=64)  # the BatchPredict path: two calls of many rows
    [merged] = await score_groups([merged], _infer, max_rows=64, callers=_callers(merged))
    assert merged.probabilities.tobytes() == batch.probabilities.tobytes()
    assert merged.usable.all() and merged.usable.tobytes() == batch.usable.tobytes()
    assert [s.source for s in merged.served] == [Source.INFERENCE] * len(records)
    assert merged.model_versions == batch.model_versions == ["+".join(["1"] * members)] * len(records)
    assert not merged.errors and len(set(merged.probabilities[0].tolist())) > 100  # not one value for all


async def test_a_row_calibration_refuses_fails_its_own_item_alone(credit_entry, credit_holdout):
    records = credit_holdout.records[:20]
    [alone] = await score_groups([_group(credit_entry, records, 1)], _infer, max_rows=64)
    group = _group(credit_entry, records, 1)
    group.family.poisoned_rows = [group.vectors[3], group.vectors[11]]
    poisoned = [k for k, row in enumerate(group.vectors) if (row == group.vectors[3]).all() or
                (row == group.vectors[11]).all()]
    assert poisoned == [3, 11]  # no other record shares their features
    [merged] = await score_groups([group], _infer, max_rows=64, callers=_callers(group))
    assert sorted(merged.errors) == [3, 11]
    assert all(e.code == "INTERNAL" and "calibrated" in e.message for e in merged.errors.values())
    kept = [k for k in range(len(records)) if k not in (3, 11)]
    assert merged.usable[kept].all() and not merged.usable[[3, 11]].any()
    assert merged.probabilities[:, kept].tobytes() == alone.probabilities[:, kept].tobytes()
