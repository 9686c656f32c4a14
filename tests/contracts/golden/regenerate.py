"""Rewrites the golden feature vectors: run only when a change to assembly or fitting is intended.

    .venv/bin/python tests/contracts/golden/regenerate.py

One file per model family, named after its feature schema version (``credit-risk-v1.json``).
Entities are chosen to cover complete rows, missing values and rare categories.
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
CONFIG = HERE.parents[2] / "config"
# credit-risk: complete rows, a missing income (30), missing assets (114), a rare home type (19).
# churn: complete rows, a missing total_charges (489: a new customer), no internet service (12).
ENTITY_IDS = {"credit-risk": ["1", "2", "3", "19", "30", "114"], "churn": ["1", "2", "3", "12", "489", "7043"]}


def golden_path(schema: FeatureSchema) -> Path:
    return HERE / (schema.version.replace("/", "-") + ".json")


def main() -> None:
    for family, entity_ids in ENTITY_IDS.items():
        schema_path = CONFIG / family / "feature-schema.toml"
        with tempfile.TemporaryDirectory() as tmp:
            entry, _ = train_family(schema_path, Path(tmp), show_progress=False)
        assembler = FeatureAssembler(entry.preprocessing)
        schema = FeatureSchema.from_toml(schema_path)
        data = load_dataset(schema)
        by_id = dict(zip(data.entity_ids, data.records))
        golden = {
            "preprocessing_hash": entry.preprocessing.hash,
            "feature_names": list(entry.preprocessing.feature_names),
            "entities": [{"entity_id": eid, "vector": assembler.assemble(by_id[eid]).vector.tolist()}
                         for eid in entity_ids],
        }
        golden_path(schema).write_text(json.dumps(golden, indent=1) + "\n")


if __name__ == "__main__":
    main()
