"""Rewrites credit-risk-v1.json: run only when a change to assembly or fitting is intended.

    .venv/bin/python tests/contracts/golden/regenerate.py

Applicants chosen to cover complete rows, a missing income, missing assets and a rare home type.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from mlpair.contracts.assembly import FeatureAssembler
from mlpair.contracts.schema import FeatureSchema
from mlpair.training.data import load_dataset
from mlpair.training.pipeline import train_family

HERE = Path(__file__).parent
SCHEMA = HERE.parents[2] / "config" / "credit-risk" / "feature-schema.toml"
ENTITY_IDS = ["1", "2", "3", "19", "30", "114"]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        entry, _ = train_family(SCHEMA, Path(tmp), show_progress=False)
    assembler = FeatureAssembler(entry.preprocessing)
    data = load_dataset(FeatureSchema.from_toml(SCHEMA))
    by_id = dict(zip(data.entity_ids, data.records))
    golden = {
        "preprocessing_hash": entry.preprocessing.hash,
        "feature_names": list(entry.preprocessing.feature_names),
        "applicants": [{"entity_id": eid, "vector": assembler.assemble(by_id[eid]).vector.tolist()} for eid in ENTITY_IDS],
    }
    (HERE / "credit-risk-v1.json").write_text(json.dumps(golden, indent=1) + "\n")


if __name__ == "__main__":
    main()
