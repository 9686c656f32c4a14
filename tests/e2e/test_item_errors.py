"""C63: a BatchPredict item's refusal carries the detail a Predict's does.

For each kind of bad input, the ErrorInfo (reason, domain, metadata), code and message of a
refused Predict equal those of the same request refused as a BatchPredict item — in a batch of a
few items (assembled row by row) and of many (column by column) — and the client's ``ItemError``
keeps them too, the "did you mean" hint of an unknown attribute included (``PREDICTION_UNKNOWN_ATTRIBUTES=refuse``).
"""

from __future__ import annotations

import grpc
import pytest

from mlpair.client import AsyncPredictionClient, BatchItem, ItemError
from mlpair.rpc import error_info
from tests.e2e.conftest import prediction_server

BAD = {  # a kind of bad input → the attributes of an item that has it
    "unconvertible": {"Age": "thirty", "Home": 4.0},
    "flag for a number": {"Age": True, "Income": 120},
    "unknown attribute": {"Incme": 120, "Age": 30},
    "unknown attributes": {"Incme": 120, "Recrds": "no", "Zzz": 1},
}


@pytest.fixture(scope="module")
async def strict(inference_server, model_repository, tmp_path_factory):
    async with prediction_server(inference_server, model_repository, tmp_path_factory.mktemp("c63"),
                                 unknown_attributes="refuse") as (target, _), AsyncPredictionClient(target) as client:
        yield client


async def test_c63_a_batch_items_refusal_carries_the_same_error_info_as_predict(strict, credit_holdout):
    client, good = strict, credit_holdout.records[0]
    expected = {}
    for kind, attributes in BAD.items():
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.predict("credit-risk", f"e-{kind}", attributes, f"c63-{kind}")
        info = error_info(refused.value)
        expected[kind] = (refused.value.code(), refused.value.details(), info.reason, info.domain, dict(info.metadata))
    assert expected["unknown attribute"][2:] == ("UNKNOWN_ATTRIBUTE", "prediction.mlpair",
                                                 {"attributes": "Incme", "did_you_mean": "Incme=Income"})
    assert "'Incme' (did you mean 'Income'?)" in expected["unknown attribute"][1]
    assert expected["unknown attributes"][4] == {"attributes": "Incme,Recrds,Zzz",
                                                 "did_you_mean": "Incme=Income,Recrds=Records"}
    assert expected["unconvertible"][2:] == ("INVALID_REQUEST", "prediction.mlpair", {"attributes": "Age,Home"})
    for size in (2 * len(BAD), 3):  # columnar (8 items and more), then row by row (a few)
        kinds = list(BAD)[: size // 2] if size > 3 else ["unknown attribute"]
        items = []
        for n, kind in enumerate(kinds):
            items += [BatchItem("credit-risk", f"e-{kind}", BAD[kind], f"c63-{size}-{kind}"),
                      BatchItem("credit-risk", "e-good", good, f"c63-{size}-good-{n}")]
        items += [BatchItem("credit-risk", "e-good", good, f"c63-{size}-good-x")] * (size - len(items))
        outcomes = await client.batch_predict(items)
        assert len(outcomes) == size
        refused = [o for o in outcomes if isinstance(o, ItemError)]
        assert len(refused) == len(kinds)
        for kind, error in zip(kinds, refused):
            code, message, reason, _, metadata = expected[kind]
            assert (error.code, error.message, error.reason, dict(error.metadata)) == (code, message, reason, metadata)
        assert [o.decision_label for o in outcomes if not isinstance(o, ItemError)]  # the good items are decided

