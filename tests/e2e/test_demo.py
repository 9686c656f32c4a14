"""`mlpair demo` as a user runs it: real processes, both families' holdouts, a report, clean stop."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

from tests.support import CONFIG_DIR


def test_demo_scores_every_holdout_record_once_and_writes_the_report(model_repository, credit_holdout, churn_holdout,
                                                                     tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mlpair.cli", "demo", "--model-repository", str(model_repository),
         "--workdir", str(tmp_path), "--config-dir", str(CONFIG_DIR)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "demo OK" in out.stdout
    for family in ("credit-risk", "churn"):
        assert f"{family} (model version" in out.stdout
    for line in ("holdout ROC AUC", "Brier score before → after calibration", "ECE (15 bins) before → after calibration"):
        assert out.stdout.count(line) == 2
    assert "MISSED" not in out.stdout
    db = sqlite3.connect(tmp_path / "crm.sqlite")
    per_family = dict(db.execute("select model_name, count(distinct request_id) from decisions "
                                 "where request_id not like '%-explain-%' group by model_name").fetchall())
    assert per_family == {"credit-risk": len(credit_holdout.records), "churn": len(churn_holdout.records)}
    assert db.execute("select count(*) - count(distinct request_id) from decisions").fetchone() == (0,)
    png = (tmp_path / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 50_000
